"""Multi-round exchanges: a compressor that declares `rounds` (aggregation "custom": PowerSGD's P then Q, the
Count Sketch's sketch then heavy values) does each round's local math in its own methods (`begin`, `after_<round>`);
here every round's buffer is summed over the ranks, in order, on the engine while the caller computes."""
from __future__ import annotations

from ..compress.base import Compressor, Round


def run_rounds(transport, compressor: Compressor, c, key, step: int, shapes=None):
    """(program) The compressor's rounds over `transport`: each round's `send` all-reduced (summed) and handed to
    `compressor.advance`; returns (sum over ranks, this rank's own contribution)."""
    state = compressor.begin(c, key, step, shapes, transport.world_size)
    while isinstance(state, Round):
        summed = yield (yield from transport.all_reduce_program(state.send, op="sum"))
        state = compressor.advance(state, summed)
    return state.total, state.own
