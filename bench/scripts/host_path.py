"""Host cost of one engine step with no model: what a small, fast model (whisper-large-v3-turbo,
flan-t5-base) cannot hide behind its GPU step. A lab script (bench/scripts is not installed).

    python bench/scripts/host_path.py --running 64,128,256 --steps 400

Modes (``--modes``, a comma list):
  scheduler  Scheduler.schedule/advance/resolve around a fake runner (the policy alone)
  engine     EngineCore.step() with a fake runner: the policy plus output processing (metrics,
             stop rules, finished outputs), for non-streamed requests (LLM.generate's path)
  stream     the same with every request streamed and detokenised each step (a fake
             tokenizer: this measures the engine's work, not a tokenizer's)
  child      stream mode as the engine process runs it: outputs as deltas
             (make_request(deltas=True)) and each step's message pickled as its writer does
  runner     engine mode with the REAL ModelRunner.launch/wait around a stubbed model on the CPU:
             adds the runner's host staging (sampling states, placeholder sources, the decode
             graph's staging buffers, sampler staging, output unpacking); no kernels run
  eager      as runner, staging through the eager path (_prepare_decode) instead of the graph's

Sampling (``--sampling``, a comma list): ``greedy`` (temperature 0), ``sampled`` (temperature
0.8, top-p 0.95) and ``seeded`` (the same, each request seeded with its own number). Only the
runner modes run the sampler; the others differ only in the requests' parameters. As the
model is stubbed, so is the race that draws the tokens (one argmax in place of the GPU's race
kernels; their CPU reference, some hundred microseconds of tensor math per step here, is
device work on a GPU): what is left is the sampler's host work. ``--race reference`` runs it.

The fake runner returns a token for every sequence at once; the overlap scheduler is on
unless ``--no-overlap``. A finished request is replaced at once, as under a steady load,
and steps that encode are left out. Prints microseconds per step and per running sequence
per step (the figure the host-path target is stated in) and, in the engine modes, the mean
steps from a request's add() to its first output token with the host time those steps took
(encoding steps included). Runs on any machine, no GPU.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import itertools
import time
from dataclasses import dataclass

import torch

from enc2dec.engine.core.batch import ModelRunnerOutput
from enc2dec.engine.core.request import Request, Sequence
from enc2dec.engine.core.scheduler import Scheduler, SchedulerLimits

TOKEN, LOGPROB = 7, -0.5
SAMPLINGS = ("greedy", "sampled", "seeded")


def _params(i: int, output_len: int, sampling: str):
    from enc2dec.engine.sampling_params import SamplingParams

    draws = {"temperature": 0.8, "top_p": 0.95} if sampling != "greedy" else {"temperature": 0.0}
    seed = {"seed": i} if sampling == "seeded" else {}
    return SamplingParams(max_tokens=output_len, ignore_eos=True, **draws, **seed)


def _request(i: int, output_len: int, sampling: str = "greedy") -> Request:
    from enc2dec.engine.runner.sampler import SeqSamplingState

    spec = SeqSamplingState(_params(i, output_len, sampling), (1,), ())
    return Request(request_id=f"r{i}", encoder_len=128, encoder_input=[5] * 128,
                   seqs=[Sequence(token_ids=[0], num_hidden_tokens=1)], max_output_tokens=output_len,
                   sampling_params=spec, eos_token_ids=frozenset({1}), ignore_eos=True)


def _scheduler(num_running: int, output_len: int) -> Scheduler:
    limits = SchedulerLimits(max_batch_size=num_running, max_num_tokens=max(8192, 129 * num_running),
                             encoder_max_batch_size=num_running, encoder_max_num_tokens=1 << 30,
                             tokens_per_block=32)
    return Scheduler(limits, num_self_blocks=num_running * (output_len // 32 + 2), num_cross_blocks=num_running * 4)


class _Done:
    def __init__(self, out: ModelRunnerOutput):
        self.out = out

    def wait(self) -> ModelRunnerOutput:
        return self.out


class FakeRunner:
    """Samples TOKEN for every sequence; remembers what the last step held."""

    def __init__(self):
        self.encoded, self.num_seqs = False, 0

    def launch(self, so):
        self.encoded, self.num_seqs = bool(so.encodes), len(so.seqs)
        n = len(so.seqs)
        return _Done(ModelRunnerOutput([TOKEN] * n, logprobs=[LOGPROB] * n))


class FakeTokenizer:
    """One character per token, at almost no cost: what is left is the engine's work."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "x" * len(ids)


class _StubModel:
    """Returns zero hidden states and logits at once: only the host work around it is left."""

    vocab = 64

    def decode(self, input_ids, positions, meta, kv):
        return torch.zeros(input_ids.shape[0], 8)

    def compute_logits(self, hidden):
        return torch.zeros(hidden.shape[0], self.vocab)

    def encode(self, inputs, meta):
        return None

    def write_cross_kv(self, hidden, meta, kv):
        pass


class _CpuGraphs:
    """DecodeGraphRunner's staging (fill_staging into two buffer sets, copy to the 'device'
    buffers) on the CPU, without capture: replay hands back stub logits."""

    def __new__(cls, max_b: int, tpb: int, max_dec: int, max_enc: int):
        from enc2dec.engine.runner.cuda_graph import DecodeGraphRunner

        g = object.__new__(DecodeGraphRunner)
        g.device, g.sizes, g.max_b, g.tpb = torch.device("cpu"), [max_b], max_b, tpb
        g.self_width, g.cross_width = -(-max_dec // tpb), -(-max_enc // tpb)
        g._make_staging(pin=False)
        logits = torch.zeros(max_b, _StubModel.vocab)
        g.graphs = {max_b: type("_NoGraph", (), {"replay": lambda self: None})()}
        g.logits = {max_b: logits}
        return g


def _real_runner(num_running: int, output_len: int, graphs: bool):
    from types import SimpleNamespace

    from enc2dec.engine.runner.model_runner import ModelRunner
    from enc2dec.engine.runner.sampler import Sampler

    r = object.__new__(ModelRunner)
    r.args = SimpleNamespace(enable_encoder_decoder_mixed_cuda_graph=False)
    r.device, r.dtype, r.is_whisper, r.tokens_per_block = torch.device("cpu"), torch.float32, False, 32
    r.model, r.kv, r.sampler, r.states, r._state_of = _StubModel(), None, Sampler(), {}, {}
    r._prev_tokens, r._prev_rows, r.encoder_graphs = None, {}, None
    r.greedy_head = None            # as on a GPU: the stub's logits are the step's whole cost there
    r._rows_ids, r._rows = [], ([], True, True)
    r._encode_stream, r.encodes_beside, r._encodes_in_flight = None, False, collections.deque()
    r.graphs = _CpuGraphs(num_running, 32, output_len + 32, 128) if graphs else None
    return _CountingRunner(r)


class _CountingRunner:
    """Forwards to a real runner and remembers what the last step held (as FakeRunner does)."""

    def __init__(self, runner):
        self.runner, self.encoded, self.num_seqs = runner, False, 0

    def launch(self, so):
        self.encoded, self.num_seqs = bool(so.encodes), len(so.seqs)
        return self.runner.launch(so)


@contextlib.contextmanager
def _stubbed_race():
    """The race's CPU versions replaced by one argmax while the block runs."""
    from enc2dec.engine.runner import sampling_ops

    saved = sampling_ops.gumbel_race_cpu, sampling_ops.filtered_race_cpu
    sampling_ops.gumbel_race_cpu = sampling_ops.filtered_race_cpu = lambda scores, *keys_and_filters: \
        scores.argmax(dim=-1)
    try:
        yield
    finally:
        sampling_ops.gumbel_race_cpu, sampling_ops.filtered_race_cpu = saved


def _engine(num_running: int, output_len: int, overlap: bool, runner: str = "fake"):
    """An EngineCore around the fake (or stub-model) runner, built without a model (only the step loop runs)."""
    from enc2dec.engine.engine_core import EngineCore, StepCounters

    core = object.__new__(EngineCore)
    core.counters = StepCounters()
    core.scheduler = _scheduler(num_running, output_len)
    core.runner = FakeRunner() if runner == "fake" else _real_runner(num_running, output_len, runner == "runner")
    core.tokenizer = FakeTokenizer()
    core.overlap = overlap
    core._inflight = None
    core._live = {}
    return core


def _track(core, req: Request, streaming: bool):
    from enc2dec.engine.engine_core import _Tracked
    from enc2dec.engine.inputs.detokenizer import IncrementalDetokenizer
    from enc2dec.engine.outputs import RequestMetrics

    params = req.sampling_params.params
    detoks = [IncrementalDetokenizer(core.tokenizer) for _ in req.seqs]
    return _Tracked(req, None, [5] * 128, params, streaming, detoks, RequestMetrics(arrival_time=req.arrival_time))


@dataclass
class Measured:
    step_s: float                  # mean seconds per decode-only step after warm-up
    num_seqs: int                  # sequences per such step
    first_token_steps: float | None = None   # engine modes: steps from add() to the first output token
    first_token_s: float | None = None       # and the step time those steps took


def measure(mode: str, num_running: int, num_steps: int, output_len: int, overlap: bool,
            clock=time.perf_counter, sampling: str = "greedy", mixed_lengths: bool = False) -> Measured:
    """Per-step host cost once ``num_running`` sequences decode; with ``mixed_lengths`` the
    requests stop after output_len/2 .. 3*output_len/2 tokens, so the batch's composition
    changes on most steps instead of once per wave."""
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {', '.join(SAMPLINGS)}, got {sampling!r}")
    ids = itertools.count()

    def length(i: int) -> int:
        return output_len // 2 + (i * 7919) % output_len if mixed_lengths else output_len

    added: dict[str, tuple[int, float]] = {}      # request id -> (step, host seconds so far) at add()
    if mode == "scheduler":
        sched, runner, pending = _scheduler(num_running, 2 * output_len), FakeRunner(), None

        def add():
            i = next(ids)
            sched.add_request(_request(i, length(i), sampling))

        def step() -> None:
            nonlocal pending
            so = sched.schedule()
            runner_out = runner.launch(so).wait()
            if not overlap:
                sched.update(so, runner_out)
                return
            sched.advance(so)
            if pending is not None:
                sched.resolve(*pending)
            pending = (so, runner_out)
    else:
        core = _engine(num_running, 2 * output_len, overlap, mode if mode in ("runner", "eager") else "fake")
        sched, runner = core.scheduler, core.runner

        def add():
            i = next(ids)
            req = _request(i, length(i), sampling)
            tracked = _track(core, req, streaming=mode in ("stream", "child"))
            tracked.deltas = mode == "child"
            core.add(tracked)
            added[req.request_id] = (i_step, host_s)

        step = core.step
        if mode == "child":
            from enc2dec.engine.engine_process import _dumps

            def step():
                outputs = core.step()
                _dumps(("out", outputs, {}))
                return outputs

    i_step, host_s = 0, 0.0
    for _ in range(num_running):
        add()
    # As EngineCore.__init__ does: the long-lived heap frozen, so no full collection lands in a step.
    gc.collect()
    gc.freeze()
    total_s = total_seqs = counted = 0
    first_steps, first_s = [], []
    for i_step in range(1, num_steps + 21):
        t0 = clock()
        step()
        dt = clock() - t0
        host_s += dt
        if added:
            live = core._live
            for rid in [rid for rid in added if rid not in live or live[rid].num_seen_tokens]:
                at_step, at_s = added.pop(rid)
                if i_step > 20:
                    first_steps.append(i_step - at_step)
                    first_s.append(host_s - at_s)
        while sched.num_running + sched.num_waiting < num_running:
            add()
        if i_step > 20 and not runner.encoded:        # decode-only steps after warm-up
            total_s += dt
            total_seqs += runner.num_seqs
            counted += 1
    gc.unfreeze()
    mean = (lambda xs: sum(xs) / len(xs) if xs else None)
    return Measured(total_s / max(1, counted), total_seqs // max(1, counted), mean(first_steps), mean(first_s))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", default="64,128,256", help="running sequences, a comma list")
    ap.add_argument("--modes", default="scheduler,engine,stream,runner,eager",
                    help="scheduler, engine, stream, child, runner, eager: a comma list")
    ap.add_argument("--sampling", default="greedy",
                    help="greedy, sampled (temperature 0.8, top-p 0.95), seeded (the same with a seed per "
                         "request): a comma list")
    ap.add_argument("--race", choices=("stub", "reference"), default="stub",
                    help="stub: one argmax draws the tokens (the host work alone); reference: the race "
                         "kernels' CPU reference")
    ap.add_argument("--profile", metavar="FILE", help="write a cProfile of all the runs to FILE")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--lengths", choices=("fixed", "mixed"), default="fixed",
                    help="fixed: every request stops at --output-len (the batch changes once per wave); mixed: "
                         "between half and 1.5 times it, so the batch changes on most steps")
    ap.add_argument("--no-overlap", action="store_true", help="wait for each step before the next")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this process's CPU time, steadier than wall time on a shared machine")
    a = ap.parse_args(argv)
    samplings = a.sampling.split(",")
    bad = [x for x in samplings if x not in SAMPLINGS]
    if bad:
        ap.error(f"--sampling: {', '.join(bad)} not among {', '.join(SAMPLINGS)}")
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    # The stub's tensor math (the CPU greedy choice over its logits, a GPU kernel in real runs)
    # would start torch's second OpenMP thread, whose spin after each parallel region --clock cpu
    # counted as host work (2.75 us a sequence a step at 256 running read 5.4 in CPU time).
    torch.set_num_threads(1)
    prof = None
    if a.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    print(f"{'mode':>9} {'sampling':>8} {'running':>8} {'seqs/step':>9} {'us/step':>9} {'us/seq/step':>11} "
          f"{'1st-token steps':>15} {'1st-token us':>12}")
    for mode in a.modes.split(","):
        for n in (int(x) for x in a.running.split(",")):
            for sampling in samplings:
                with _stubbed_race() if a.race == "stub" else contextlib.nullcontext():
                    m = measure(mode, n, a.steps, a.output_len, not a.no_overlap, clock, sampling,
                                a.lengths == "mixed")
                first = ("-", "-") if m.first_token_steps is None else \
                    (f"{m.first_token_steps:.2f}", f"{m.first_token_s * 1e6:.0f}")
                print(f"{mode:>9} {sampling:>8} {n:>8} {m.num_seqs:>9} {m.step_s * 1e6:>9.0f} "
                      f"{m.step_s * 1e6 / max(1, m.num_seqs):>11.2f} {first[0]:>15} {first[1]:>12}")
    if prof is not None:
        prof.disable()
        prof.dump_stats(a.profile)


if __name__ == "__main__":
    main()
