"""Host cost of one engine step with no model: what a small, fast model (whisper-large-v3-turbo,
flan-t5-base) cannot hide behind its GPU step. A lab script (bench/scripts is not installed).

    python bench/scripts/host_path.py --running 64,128,256 --steps 400

Modes (``--modes``, a comma list):
  scheduler  Scheduler.schedule/advance/resolve around a fake runner (the policy alone)
  engine     EngineCore.step() with a fake runner: the policy plus output processing (metrics,
             stop rules, finished outputs), for non-streamed requests (LLM.generate's path)
  stream     the same with every request streamed and detokenised each step (a fake
             tokenizer: this measures the engine's work, not a tokenizer's)
  runner     engine mode with the REAL ModelRunner.launch/wait around a stubbed model on the CPU:
             adds the runner's host staging (sampling states, placeholder sources, the decode
             graph's staging buffers, sampler staging, output unpacking); no kernels run
  eager      as runner, staging through the eager path (_prepare_decode) instead of the graph's

The fake runner returns a token for every sequence at once; the overlap scheduler is on
unless ``--no-overlap``. A finished request is replaced at once, as under a steady load,
and steps that encode are left out. Prints microseconds per step and per running sequence
per step (the figure the host-path target is stated in). Runs on any machine, no GPU.
"""
from __future__ import annotations

import argparse
import itertools
import time

import torch

from enc2dec.engine.core.batch import ModelRunnerOutput
from enc2dec.engine.core.request import Request, Sequence
from enc2dec.engine.core.scheduler import Scheduler, SchedulerLimits

TOKEN, LOGPROB = 7, -0.5


def _request(i: int, output_len: int) -> Request:
    from enc2dec.engine.runner.sampler import SeqSamplingState
    from enc2dec.engine.sampling_params import SamplingParams

    spec = SeqSamplingState(SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0), (1,), ())
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
        n32 = (max_b + 1) + 2 * max_b + max_b * (g.self_width + g.cross_width)
        g._staging = [(torch.zeros(4 * max_b, dtype=torch.long), torch.zeros(n32, dtype=torch.int32)) for _ in range(2)]
        g._turn = 0
        g._dev64, g._dev32 = torch.zeros(4 * max_b, dtype=torch.long), torch.zeros(n32, dtype=torch.int32)
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
    r.graphs = _CpuGraphs(num_running, 32, output_len + 32, 128) if graphs else None
    return _CountingRunner(r)


class _CountingRunner:
    """Forwards to a real runner and remembers what the last step held (as FakeRunner does)."""

    def __init__(self, runner):
        self.runner, self.encoded, self.num_seqs = runner, False, 0

    def launch(self, so):
        self.encoded, self.num_seqs = bool(so.encodes), len(so.seqs)
        return self.runner.launch(so)


def _engine(num_running: int, output_len: int, overlap: bool, runner: str = "fake"):
    """An EngineCore around the fake (or stub-model) runner, built without a model (only the step loop runs)."""
    from enc2dec.engine.engine_core import EngineCore

    core = object.__new__(EngineCore)
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
    from enc2dec.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=req.max_output_tokens, ignore_eos=True, temperature=0.0)
    detoks = [IncrementalDetokenizer(core.tokenizer) for _ in req.seqs]
    return _Tracked(req, None, [5] * 128, params, streaming, detoks, RequestMetrics(arrival_time=req.arrival_time))


def measure(mode: str, num_running: int, num_steps: int, output_len: int, overlap: bool,
            clock=time.perf_counter) -> tuple[float, int]:
    """Mean seconds per decode-only step once ``num_running`` sequences decode, and the sequences per step."""
    ids = itertools.count()
    if mode == "scheduler":
        sched, runner, pending = _scheduler(num_running, output_len), FakeRunner(), None

        def add():
            sched.add_request(_request(next(ids), output_len))

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
        core = _engine(num_running, output_len, overlap, mode if mode in ("runner", "eager") else "fake")
        sched, runner = core.scheduler, core.runner

        def add():
            core.add(_track(core, _request(next(ids), output_len), streaming=mode == "stream"))

        step = core.step
    for _ in range(num_running):
        add()
    total_s = total_seqs = counted = 0
    for i in range(num_steps + 20):
        t0 = clock()
        step()
        dt = clock() - t0
        while sched.num_running + sched.num_waiting < num_running:
            add()
        if i >= 20 and not runner.encoded:        # decode-only steps after warm-up
            total_s += dt
            total_seqs += runner.num_seqs
            counted += 1
    return total_s / max(1, counted), total_seqs // max(1, counted)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", default="64,128,256", help="running sequences, a comma list")
    ap.add_argument("--modes", default="scheduler,engine,stream,runner,eager",
                    help="scheduler, engine, stream, runner, eager: a comma list")
    ap.add_argument("--profile", metavar="FILE", help="write a cProfile of all the runs to FILE")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--no-overlap", action="store_true", help="wait for each step before the next")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this process's CPU time, steadier than wall time on a shared machine")
    a = ap.parse_args(argv)
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    prof = None
    if a.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    print(f"{'mode':>9} {'running':>8} {'seqs/step':>9} {'us/step':>9} {'us/seq/step':>11}")
    for mode in a.modes.split(","):
        for n in (int(x) for x in a.running.split(",")):
            per_step_s, seqs = measure(mode, n, a.steps, a.output_len, not a.no_overlap, clock)
            print(f"{mode:>9} {n:>8} {seqs:>9} {per_step_s * 1e6:>9.0f} {per_step_s * 1e6 / max(1, seqs):>11.2f}")
    if prof is not None:
        prof.disable()
        prof.dump_stats(a.profile)


if __name__ == "__main__":
    main()
