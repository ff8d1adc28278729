"""A Hugging Face model raced like any workload: GPT-2 from a config, randomly
initialised (nothing is downloaded), 2 layers of width 128 over bytes as tokens
(446 k parameters), trained on the Python standard library's source (or on
your text) with the language-model loss as the metric. Needs `transformers`,
the extra `hf`: pip install 'transformers==5.23.0' 'torch==2.13.0'.

    thinwire train --workload examples/hf_gpt2.py:make --workers 2 --steps 30
    thinwire compare --workload examples/hf_gpt2.py:make \\
        --algorithms "bsp;diloco" --network world --workers 4 --budget 60

Your own text: set TEXT to it (e.g. open("notes.txt").read()); its last 10 %
is held out.
"""
from transformers import GPT2Config

from thinwire.run.hf import causal_lm

TEXT = None     # None: the standard library's source


def make():
    config = GPT2Config(vocab_size=256, n_positions=128, n_embd=128,
                        n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    return causal_lm(config, text=TEXT, name="gpt2-tiny", context=64)
