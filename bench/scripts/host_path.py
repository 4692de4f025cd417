"""Host cost of one engine step with no model: the scheduler's schedule/advance/resolve around
a fake runner that returns a token for every sequence at once. What this measures is what a
small, fast model (whisper-large-v3-turbo, flan-t5-base) cannot hide behind its GPU step.

    python bench/scripts/host_path.py --running 64,128,256 --steps 400

Prints microseconds per step and per running sequence per step (the figure the host-path
target is stated in). Pure Python: it runs on any machine, with no torch.
"""
from __future__ import annotations

import argparse
import itertools
import time

from enc2dec.engine.core.batch import ModelRunnerOutput, SampledToken
from enc2dec.engine.core.request import Request, Sequence
from enc2dec.engine.core.scheduler import Scheduler, SchedulerLimits


def _request(i: int, output_len: int) -> Request:
    return Request(request_id=f"r{i}", encoder_len=128, encoder_input=[5] * 128,
                   seqs=[Sequence(token_ids=[0], num_hidden_tokens=1)], max_output_tokens=output_len,
                   eos_token_ids=frozenset({1}), ignore_eos=True)


def measure(num_running: int, num_steps: int, output_len: int, overlap: bool) -> tuple[float, int]:
    """Mean seconds per step once ``num_running`` sequences decode, and the sequences per step."""
    limits = SchedulerLimits(max_batch_size=num_running, max_num_tokens=max(8192, 129 * num_running),
                             encoder_max_batch_size=num_running, encoder_max_num_tokens=1 << 30,
                             tokens_per_block=32)
    blocks = num_running * (output_len // 32 + 2)
    sched = Scheduler(limits, num_self_blocks=blocks, num_cross_blocks=num_running * 4)
    ids = itertools.count()
    for _ in range(num_running):
        sched.add_request(_request(next(ids), output_len))
    token = SampledToken(7, -0.5)
    pending = None
    total_s = total_seqs = counted = 0
    for step in range(num_steps + 20):
        t0 = time.perf_counter()
        so = sched.schedule()
        runner_out = ModelRunnerOutput(sampled={s.seq_id: token for s in so.seqs})
        if overlap:
            sched.advance(so)
            if pending is not None:
                sched.resolve(*pending)
            pending = (so, runner_out)
        else:
            sched.update(so, runner_out)
        dt = time.perf_counter() - t0
        # Keep the batch full: a finished request is replaced, as under a steady load.
        while sched.num_running + sched.num_waiting < num_running:
            sched.add_request(_request(next(ids), output_len))
        if step >= 20 and not so.encodes:        # decode-only steps after warm-up
            total_s += dt
            total_seqs += len(so.seqs)
            counted += 1
    return total_s / max(1, counted), total_seqs // max(1, counted)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", default="64,128,256", help="running sequences, a comma list")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--no-overlap", action="store_true", help="schedule/update instead of advance/resolve")
    a = ap.parse_args(argv)
    print(f"{'running':>8} {'seqs/step':>9} {'us/step':>9} {'us/seq/step':>11}")
    for n in (int(x) for x in a.running.split(",")):
        per_step_s, seqs = measure(n, a.steps, a.output_len, not a.no_overlap)
        print(f"{n:>8} {seqs:>9} {per_step_s * 1e6:>9.0f} {per_step_s * 1e6 / max(1, seqs):>11.2f}")


if __name__ == "__main__":
    main()
