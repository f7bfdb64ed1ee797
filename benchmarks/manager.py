"""``kvstore bench manager``: what the cache manager's scheduler-facing calls cost, side by side
with another git revision of kvstore or vLLM's v1 ``KVCacheManager`` (docs/cache_layer.md, "Hot
path"). Run as ``manager.py --worker kvstore|vllm SPECS``, this file serves one side; at module
level it imports only the standard library, so one revision's core on the path is enough."""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:  # the worker imports only the standard library at module level
    from kvstore.benchmarks.tier_model import PlaceholderConnector
    from kvstore.kv_cache_manager import KVCacheManager
    from kvstore.specs import KVCacheConfig

BLOCK_SIZE = 16
WINDOW = 1024
MAX_RUNNING = 64
TOKEN_BUDGET = 8192
STEP_TIME = 0.02
# Pools in blocks (pressured, roomy) per layout.
POOLS: dict[str, tuple[int, int]] = {"full": (3000, 16000), "hybrid": (4500, 28000), "gemma3": (12000, 60000)}
SCENARIOS = tuple(f"{layout}/{regime}" for layout in POOLS for regime in ("pressured", "roomy"))
# (sliding-window layers, full layers) per layout; a vLLM KV cache group holds n_full layers.
LAYERS: dict[str, tuple[int, int]] = {"full": (0, 32), "hybrid": (16, 16), "gemma3": (25, 5)}
WORKLOADS: tuple[str, ...] = ("shared-prefix", "chat", "few-shot")
CALLS: tuple[str, ...] = ("lookup", "admit", "decode", "free")
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Spec:
    """One request: its arrival (seconds), prompt and the exact tokens it decodes."""

    request_id: str
    prompt: list[int]
    outputs: list[int]
    arrival: float = 0.0


@dataclass
class ManagerResult:
    """Timings (seconds, summed over calls) and counters of one replay on one side."""

    side: str
    scenario: str
    num_blocks: int
    # lookup, admit, chunk (a running request's next prefill chunk), decode, free, failed
    # (lookups + admissions refused for lack of room), step (the per-step calls)
    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    hash_s: float = 0.0
    finished: int = 0
    steps: int = 0
    preemptions: int = 0
    first_hit_tokens: int = 0
    prompt_tokens: int = 0
    evictions: int = -1  # -1: the side does not count them
    build_s: float = 0.0
    bytes_per_block: float = 0.0

    @property
    def manager_s(self) -> float:
        """Seconds in the manager's calls plus hashing."""
        return sum(self.seconds.values()) + self.hash_s

    @property
    def hit_rate(self) -> float:
        """Hit tokens at each request's first admission over prompt tokens."""
        return self.first_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def add(self, call: str, seconds: float) -> None:
        """Count one call of `call` that took `seconds`."""
        self.seconds[call] = self.seconds.get(call, 0.0) + seconds
        self.calls[call] = self.calls.get(call, 0) + 1

    def us(self, call: str) -> float | None:
        """Mean microseconds per call of `call`."""
        n = self.calls.get(call)
        return 1e6 * self.seconds[call] / n if n else None


def new_manager(config: KVCacheConfig, tiers: PlaceholderConnector | None = None,
                **options: Any) -> KVCacheManager:
    """A KVCacheManager of `config`, CacheConfig fields `options` (TypeError if unknown), `tiers` attached."""
    from kvstore import kv_cache_manager
    from kvstore.kv_cache_manager import KVCacheManager

    cache_config = getattr(kv_cache_manager, "CacheConfig", None)
    known = inspect.signature(cache_config or KVCacheManager).parameters
    if missing := [k for k in options if k not in known]:
        raise TypeError(f"this revision's KVCacheManager has no {', '.join(missing)}")
    if cache_config is None:  # a revision before CacheConfig takes them as keyword arguments
        manager = KVCacheManager(config, **options)
    else:
        manager = KVCacheManager(config, cache_config(**options))
    if tiers is not None:
        tiers.attach(manager)
    return manager


class Side:
    """A manager behind the driver's calls; a subclass builds `manager` and hashes."""

    name = ""
    manager: Any
    hash_s = 0.0

    def timed_hash(self, fn: Callable[[Any], Any], request: Any) -> Any:
        """`fn(request)`, its time added to `hash_s`."""
        t0 = time.perf_counter()
        out = fn(request)
        self.hash_s += time.perf_counter() - t0
        return out

    def grow(self, request: Any, num_new: int) -> bool:
        """Pages for `num_new` more tokens of a running request; False when none are left."""
        return self.manager.allocate_slots(request, num_new) is not None

    def free(self, request: Any) -> None:
        """Release a finished or preempted request."""
        self.manager.free(request)

    def step_start(self) -> None:
        """The side's notice to its manager that a step starts, if any."""

    def step_end(self) -> None:
        """The side's work once a step is scheduled, if any."""

    def evictions(self) -> int:
        """Cached blocks evicted so far; -1 when the side does not count them."""
        return -1


class KvstoreSide(Side):
    """kvstore's KVCacheManager (any revision with get_computed_blocks, allocate_slots and free)."""

    name = "kvstore"

    def __init__(self, layout: str, num_blocks: int, options: dict[str, Any]) -> None:
        from kvstore import hashing
        from kvstore.request import Request
        from kvstore.specs import FullAttentionSpec, SlidingWindowSpec, make_kv_cache_config

        n_slide, n_full = LAYERS[layout]
        full = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_dim=128)
        slide = SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_dim=128, window=WINDOW)
        config = make_kv_cache_config([slide] * n_slide + [full] * n_full, num_blocks=num_blocks)
        self.manager = new_manager(config, **options)
        self._request = Request
        self.hash_fn = getattr(self.manager, "hash_fn", hashing.hash_block)

    def _hash(self, request: Any) -> None:
        self.timed_hash(lambda r: r.update_block_hashes(BLOCK_SIZE, self.hash_fn), request)

    def new_request(self, spec: Spec) -> Any:
        """A request for `spec`, its prompt hashed (timed)."""
        request = self._request(spec.request_id, spec.prompt, None, len(spec.outputs))
        self._hash(request)
        return request

    def append(self, request: Any, token: int) -> None:
        """Append a sampled token, hashing a block it fills (timed)."""
        request.append_token_ids(token)
        if len(request.token_ids) % BLOCK_SIZE == 0:
            self._hash(request)

    def lookup(self, request: Any) -> tuple[Any, int]:
        """The hit and its tokens."""
        computed = self.manager.get_computed_blocks(request)
        return computed, computed.num_computed_tokens

    def admit(self, request: Any, num_new: int, computed: Any, num_hit: int) -> bool:
        """Admit on the hit (progress set to the hit); False when the pool cannot hold it."""
        return self.manager.allocate_slots(request, num_new, computed) is not None

    def step_end(self) -> None:  # the copies the worker would run before the step
        self.manager.take_pending_copies()

    def leaked(self) -> bool:
        """Whether any block is still held once every request is freed."""
        self.manager.take_pending_copies()
        m = self.manager  # an older revision keeps the counts on its pool
        pool = m if hasattr(m, "num_free_blocks") else (getattr(m, "_pool", None) or m.pool)
        return bool(pool.num_free_blocks != pool.num_usable_blocks)

    def evictions(self) -> int:
        return int(self.manager.stats.evictions)


class VllmSide(Side):
    """vLLM's v1 KVCacheManager (CPU; sha256 block hashes, vLLM's default)."""

    name = "vllm"

    def __init__(self, layout: str, num_blocks: int, options: dict[str, Any]) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1 import kv_cache_interface as kvi
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        kw: dict[str, Any] = {"block_size": BLOCK_SIZE, "num_kv_heads": 8, "head_size": 128,
                              "dtype": torch.float16}
        n_slide, per_group = LAYERS[layout]
        groups = [kvi.KVCacheGroupSpec([f"s{g}.{j}" for j in range(per_group)],
                                       kvi.SlidingWindowSpec(**kw, sliding_window=WINDOW))
                  for g in range(n_slide // per_group)]
        groups.append(kvi.KVCacheGroupSpec([f"f.{j}" for j in range(per_group)], kvi.FullAttentionSpec(**kw)))
        config = kvi.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        self.manager = KVCacheManager(config, max_model_len=1 << 20, scheduler_block_size=BLOCK_SIZE,
                                      hash_block_size=BLOCK_SIZE, enable_caching=True)
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        self._hasher = lambda request: self.timed_hash(hasher, request)
        self._request = Request
        self._params = SamplingParams

    def new_request(self, spec: Spec) -> Any:
        """A request for `spec`; it hashes its prompt on creation (timed)."""
        return self._request(spec.request_id, list(spec.prompt), self._params(max_tokens=len(spec.outputs)),
                             None, arrival_time=0.0, block_hasher=self._hasher)

    def append(self, request: Any, token: int) -> None:
        """Append a sampled token; the request hashes a block it fills (timed)."""
        request.append_output_token_ids(token)

    def lookup(self, request: Any) -> tuple[Any, int]:
        """The hit and its tokens."""
        blocks, num_hit, _ = self.manager.get_computed_blocks(request)
        return blocks, num_hit

    def admit(self, request: Any, num_new: int, computed: Any, num_hit: int) -> bool:
        """Admit on the hit as vLLM's scheduler does; sets progress to the hit."""
        ok = self.manager.allocate_slots(request, num_new, num_hit, computed) is not None
        if ok:
            request.num_computed_tokens = num_hit
        return ok

    def step_start(self) -> None:
        self.manager.new_step_starts()

    def leaked(self) -> bool:
        """Whether any block is still held once every request is freed."""
        pool = self.manager.block_pool
        return bool(pool.get_num_free_blocks() != pool.num_gpu_blocks - 1)


def drive(side: Any, specs: list[Spec], scenario: str, num_blocks: int,
          max_running: int = MAX_RUNNING, budget_tokens: int = TOKEN_BUDGET) -> ManagerResult:
    """Replay `specs` through `side` with vLLM's scheduler loop reduced to the manager calls."""
    perf = time.perf_counter
    res = ManagerResult(side.name, scenario, num_blocks, prompt_tokens=sum(len(s.prompt) for s in specs))
    pending = deque(sorted(specs, key=lambda s: s.arrival))
    waiting: deque[tuple[Spec, Any]] = deque()
    running: list[tuple[Spec, Any]] = []
    admitted_once: set[str] = set()
    clock = 0.0

    def timed(call: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = perf()
        out = fn(*args)
        res.add(call, perf() - t0)
        return out

    while pending or waiting or running:
        if not waiting and not running and pending[0].arrival > clock:
            clock = pending[0].arrival
        while pending and pending[0].arrival <= clock:
            s = pending.popleft()
            waiting.append((s, side.new_request(s)))
        timed("step", side.step_start)
        budget = budget_tokens
        scheduled: list[tuple[Spec, Any, int]] = []
        preempted = False
        i = 0
        while i < len(running) and budget > 0:  # running requests first, preempting the latest
            spec, request = running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            call = "decode" if num_new == 1 else "chunk"
            while not (ok := timed(call, side.grow, request, num_new)):
                victim_spec, victim = running.pop()
                timed("free", side.free, victim)
                victim.num_computed_tokens = 0
                waiting.appendleft((victim_spec, victim))
                res.preemptions += 1
                preempted = True
                if victim is request:
                    break
            if not ok:
                break
            scheduled.append((spec, request, num_new))
            budget -= num_new
            i += 1
        while not preempted and waiting and budget > 0 and len(running) < max_running:
            spec, request = waiting[0]
            t0 = perf()
            computed, num_hit = side.lookup(request)
            t1 = perf()
            num_new = min(request.num_tokens - num_hit, budget)
            ok = side.admit(request, num_new, computed, num_hit)
            t2 = perf()
            if not ok:
                res.add("failed", t2 - t0)
                break
            res.add("lookup", t1 - t0)
            res.add("admit", t2 - t1)
            if spec.request_id not in admitted_once:
                admitted_once.add(spec.request_id)
                res.first_hit_tokens += request.num_computed_tokens
            waiting.popleft()
            running.append((spec, request))
            scheduled.append((spec, request, num_new))
            budget -= num_new
        timed("step", side.step_end)
        res.steps += 1
        for spec, request, num_new in scheduled:
            request.num_computed_tokens += num_new
            if request.num_computed_tokens < request.num_tokens:
                continue
            side.append(request, spec.outputs[request.num_tokens - len(spec.prompt)])
            if request.num_tokens - len(spec.prompt) >= len(spec.outputs):
                running.remove((spec, request))
                timed("free", side.free, request)
                res.finished += 1
        clock += STEP_TIME
        if res.steps > 1_000_000:
            raise RuntimeError(f"{scenario}: no progress after {res.steps} steps")
    if side.leaked():
        raise RuntimeError(f"{scenario}: blocks leaked once every request finished")
    res.hash_s = side.hash_s
    res.evictions = side.evictions()
    return res


def run_scenario(kind: str, scenario: str, num_blocks: int, specs: list[Spec],
                 options: dict[str, Any], scale: bool = False) -> ManagerResult:
    """One replay here, cyclic GC off (as timeit does); `scale` adds build time and bytes per block."""
    side_cls = VllmSide if kind == "vllm" else KvstoreSide
    layout = scenario.split("/")[0]
    build_s = per_block = 0.0
    if scale:
        gc.collect()
        tracemalloc.start()
        t0 = time.perf_counter()
        side_cls(layout, num_blocks, options)
        build_s = time.perf_counter() - t0
        per_block = tracemalloc.get_traced_memory()[1] / num_blocks
        tracemalloc.stop()
    side = side_cls(layout, num_blocks, options)
    gc.collect()
    gc.disable()
    try:
        res = drive(side, specs, scenario, num_blocks)
    finally:
        gc.enable()
    res.build_s, res.bytes_per_block = build_s, per_block
    return res


def worker_main(kind: str, spec_path: str) -> None:
    """Print where the code lives, then answer each stdin line (`run_scenario`'s arguments) or its error."""
    mod = __import__("vllm" if kind == "vllm" else "kvstore.kv_cache_manager")
    print(json.dumps(f"{getattr(mod, '__version__', '')} {mod.__file__}".strip()), flush=True)
    specs = [Spec(**s) for s in json.loads(Path(spec_path).read_text())]
    for line in sys.stdin:
        try:
            out = asdict(run_scenario(kind, specs=specs, **json.loads(line)))
        except Exception as exc:  # reported to the parent, which decides
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)


def cache_layer_tree(src_kvstore: Path, dest: Path) -> Path:
    """`dest`, to put on the path so that ``kvstore`` is `src_kvstore` alone (empty ``__init__``)."""
    pkg = dest / "kvstore"
    pkg.mkdir(parents=True)
    for f in sorted(src_kvstore.iterdir()):
        if f.name not in ("__pycache__", "__init__.py"):
            (pkg / f.name).symlink_to(f.resolve())
    (pkg / "__init__.py").write_text("")
    return dest


class Worker:
    """A worker subprocess replaying the specs in `spec_path` on one side."""

    def __init__(self, label: str, kind: str, python: str, pythonpath: str | None,
                 spec_path: Path, options: dict[str, Any] | None = None) -> None:
        env = dict(os.environ, PYTHONHASHSEED="0")  # vLLM's NONE_HASH seed
        if pythonpath is not None:
            env["PYTHONPATH"] = pythonpath
        self.label, self.options = label, dict(options or {})
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--worker", kind, str(spec_path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, cwd=tempfile.gettempdir())
        self.where = str(self._read())

    def _read(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.label} exited (rc {self.proc.wait()})")
        return json.loads(line)

    def ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Send one scenario (`run_scenario`'s keyword arguments) and wait for its result."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return dict(self._read())

    def result(self, scenario: str, num_blocks: int | None = None, **extra: Any) -> ManagerResult:
        """Replay `scenario` (on its pool unless `num_blocks`); RuntimeError on the worker's error."""
        layout, _, regime = scenario.partition("/")
        if num_blocks is None:
            num_blocks = POOLS[layout][regime == "roomy"]
        out = self.ask({"scenario": scenario, "num_blocks": num_blocks, "options": self.options, **extra})
        if "error" in out:
            raise RuntimeError(f"{self.label}, {scenario}: {out['error']}")
        return ManagerResult(**out)

    def close(self) -> None:
        """Stop the subprocess."""
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def make_specs(workload: str, num_requests: int, seed: int = 0) -> list[Spec]:
    """The named workload (``shared-prefix``, ``chat`` or ``few-shot``: docs/cache_layer.md), seeded."""
    import numpy as np

    from kvstore.benchmarks import workloads as wl

    rng = np.random.default_rng(seed)

    def tokens(n: Any) -> list[int]:
        return rng.integers(0, 32000, size=int(n)).tolist()

    if workload == "shared-prefix":
        systems = [tokens(n) for n in rng.integers(200, 801, size=8)]
        weights = 1.0 / np.arange(1, 9)
        which = rng.choice(8, size=num_requests, p=weights / weights.sum())
        specs = []
        for i, w in enumerate(which):
            system = systems[int(w)]
            user = tokens(int(rng.integers(max(500, len(system) + 1), 2001)) - len(system))
            specs.append(Spec(f"r{i:04d}", system + user, tokens(rng.integers(100, 301))))
        return specs
    if workload == "chat":
        reqs = wl.multi_turn_chat(max(1, num_requests // 5), (3, 8), system_len=301, user_len=(20, 300),
                                  output_median=100, output_max=600, rate=2.0, think_time=2.0,
                                  seed=seed).requests
    else:
        reqs = wl.few_shot(num_requests, 8, num_tasks=6, example_len=(40, 200), question_len=(16, 128),
                           output_median=60, output_max=400, rate=20.0, seed=seed).requests
    return [Spec(r.request_id, list(r.prompt_token_ids), list(r.output_token_ids or tokens(r.max_tokens)),
                 r.arrival) for r in reqs]


def ideal_hit_rate(specs: list[Spec], block_size: int | None = BLOCK_SIZE) -> float:
    """An infinite cache's first-admission hit rate, in whole blocks or token-exact (`block_size` None)."""
    from kvstore.benchmarks.workloads import RequestSpec, ideal_hit_tokens

    reqs = [RequestSpec(s.request_id, s.arrival, tuple(s.prompt), len(s.outputs),
                        output_token_ids=tuple(s.outputs)) for s in specs]
    return ideal_hit_tokens(reqs, block_size, include_outputs=True).rate


def _option(text: str) -> dict[str, Any]:
    """argparse type: ``KEY=VALUE[,KEY=VALUE]`` (true/false, numbers, else strings) CacheConfig accepts."""
    from kvstore.kv_cache_manager import CacheConfig

    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.isidentifier():
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {part!r}")
        low = value.lower()
        out[key] = (low == "true" if low in ("true", "false")
                    else int(value) if value.lstrip("-").isdigit() else value)
    known = [f.name for f in fields(CacheConfig)]
    if unknown := [k for k in out if k not in known]:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; known: {', '.join(known)}")
    try:
        CacheConfig(**out)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return out


def _check_vllm(python: str, error: Callable[[str], NoReturn]) -> None:
    """A usage error unless `python` runs and imports vLLM's v1 KVCacheManager."""
    try:
        found = subprocess.run([python, "-c", "import vllm.v1.core.kv_cache_manager"],
                               capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        error(f"argument --vllm: cannot run {python}: {getattr(e, 'strerror', None) or e}")
    if found.returncode:
        why = (found.stderr.strip().splitlines() or [f"exit status {found.returncode}"])[-1]
        error(f"argument --vllm: {python} cannot import vllm.v1.core.kv_cache_manager ({why}); "
              "install vLLM under that interpreter")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kvstore bench manager``."""
    from kvstore.benchmarks.output import name_list, non_negative_int, positive_int

    p.add_argument("--quick", action="store_true", help="60 requests, one repeat")
    p.add_argument("--workload", choices=WORKLOADS, default="shared-prefix")
    p.add_argument("--requests", type=positive_int, metavar="N",
                   help="requests (default: 400, 60 with --quick); with --workload chat, max(1, N // 5) "
                        "conversations of 3 to 8 turns, each turn a request")
    p.add_argument("--seed", type=non_negative_int, default=0, help="workload seed (default: 0)")
    p.add_argument("--repeats", type=positive_int,
                   help="alternated replays, fastest kept (default: 3, 1 with --quick)")
    p.add_argument("--scenarios", type=name_list(SCENARIOS), default=list(SCENARIOS), metavar="LIST",
                   help=f"comma list of {', '.join(SCENARIOS)}")
    p.add_argument("--vs", metavar="REV", help="also run this git revision's kvstore/ (a temporary worktree)")
    p.add_argument("--vllm", metavar="PYTHON",
                   help="also run vLLM's v1 KVCacheManager under this interpreter")
    p.add_argument("--also", type=_option, action="append", default=[], metavar="KEY=VALUE",
                   help="also run this revision with KVCacheManager options, e.g. "
                        "eviction=window or enable_partial_hits=false (repeatable)")
    p.add_argument("--scale", action="store_true", help="also pools of 16k, 100k and 1M blocks (full "
                   "layout, roomy): build time, bytes per block, call costs")


def run(args: argparse.Namespace) -> int:
    """Run the sides of `args` side by side; print per-side tables, ratios and a headline."""
    if args.vllm:
        _check_vllm(args.vllm, args.usage_error)
    repeats = args.repeats or (1 if args.quick else 3)
    t_start = time.perf_counter()
    specs = make_specs(args.workload, args.requests or (60 if args.quick else 400), args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="kvstore_manager_"))
    spec_file = tmp / "specs.json"
    spec_file.write_text(json.dumps([asdict(s) for s in specs]))
    git = ["git", "-C", str(REPO)]
    workers: list[Worker] = []
    try:
        this = subprocess.run([*git, "describe", "--always", "--dirty"], capture_output=True,
                              text=True).stdout.strip() or "this tree"
        tree = str(cache_layer_tree(REPO / "kvstore", tmp / "this"))
        for options in [{}, *args.also]:
            given = ",".join(f"{k}={v}" for k, v in options.items())
            label = f"this, {given}" if options else f"this ({this})"
            workers.append(Worker(label, "kvstore", sys.executable, tree, spec_file, options))
        if args.vs:
            worktree = tmp / "vs-worktree"
            if subprocess.run([*git, "worktree", "add", "--detach", "-q", str(worktree), args.vs],
                              capture_output=True).returncode:
                args.usage_error(f"argument --vs: {args.vs!r} is not a revision of {REPO}")
            workers.append(Worker(f"kvstore {args.vs}", "kvstore", sys.executable,
                                  str(cache_layer_tree(worktree / "kvstore", tmp / "vs")), spec_file))
        if args.vllm:
            workers.append(Worker("vLLM", "vllm", args.vllm, None, spec_file))
        print(f"Manager + hashing cost: {args.workload} (seed {args.seed}), {len(specs)} requests, "
              f"best of {repeats} alternated replays\nideal first-admission hit rate "
              f"{ideal_hit_rate(specs):.4f} whole blocks, {ideal_hit_rate(specs, None):.4f} token-exact")
        for w in workers:  # a kvstore worker runs a temporary copy of a kvstore/ tree
            source = (f"kvstore/ at {args.vs}" if w.label == f"kvstore {args.vs}"
                      else f"{REPO / 'kvstore'}" if w.label.startswith("this") else w.where)
            print(f"  {w.label}: {source}")
        best: dict[str, list[ManagerResult]] = {w.label: [] for w in workers}
        for k, scenario in enumerate(args.scenarios, 1):
            print(f"  [{k}/{len(args.scenarios)}] {scenario} ...", file=sys.stderr, flush=True)
            replays = [[w.result(scenario) for w in workers] for _ in range(repeats)]
            for w, results in zip(workers, zip(*replays, strict=True), strict=True):
                best[w.label].append(min(results, key=lambda r: r.manager_s))
        mine, others = best[workers[0].label], {w.label: best[w.label] for w in workers[1:]}
        print_tables(best, mine, others)
        if args.scale:
            print_scale(workers, (16_000, 100_000) if args.quick else (16_000, 100_000, 1_000_000))
        print_headline(workers[0].label, mine, others, time.perf_counter() - t_start)
    finally:
        for w in workers:
            w.close()
        if args.vs:
            subprocess.run([*git, "worktree", "remove", "--force", str(tmp / "vs-worktree")],
                           check=False, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def print_tables(best: dict[str, list[ManagerResult]], mine: list[ManagerResult],
                 others: dict[str, list[ManagerResult]]) -> None:
    """Each side's table, then per scenario this revision's time over each other side's."""
    from kvstore.benchmarks.output import fmt, text_table

    per_side = ("lookup", "admit", "chunk", "decode", "free")
    for label, rows in best.items():
        print(f"\n{label}: µs/call (mean), s in all, first-admission hit rate")
        print(text_table(("scenario", *per_side, "s", "hit", "preempt", "evict"), (
            [r.scenario, *(fmt(r.us(c), ".2f" if c == "decode" else ".1f") for c in per_side),
             f"{r.manager_s:.3f}", f"{r.hit_rate:.4f}", r.preemptions,
             r.evictions if r.evictions >= 0 else "-"] for r in rows)))

    def ratio(a: ManagerResult, b: ManagerResult, call: str) -> str:
        x, y = a.us(call), b.us(call)
        return f"{x / y:.2f}" if x is not None and y else "-"

    for label, rows in others.items():
        print(f"\nthis / {label}: time per call (below 1: faster here)")
        print(text_table(("scenario", "total", *CALLS, "hit here", "there"), (
            [a.scenario, f"{a.manager_s / b.manager_s:.3f}", *(ratio(a, b, c) for c in CALLS),
             f"{a.hit_rate:.4f}", f"{b.hit_rate:.4f}"] for a, b in zip(mine, rows, strict=True))))


def print_scale(workers: list[Worker], pools: tuple[int, ...]) -> None:
    """Build time, bookkeeping bytes per block and µs per call of each side at each pool."""
    from kvstore.benchmarks.output import fmt, text_table

    rows = [(w.label[:24], f"{n:,}", f"{r.build_s:.2f}", f"{r.bytes_per_block:.0f}",
             *(fmt(r.us(c), ".2f") for c in CALLS))
            for n in pools for w in workers for r in [w.result("full/roomy", n, scale=True)]]
    print("\nScale: full layout, roomy pools (no eviction)\n")
    print(text_table(("side", "blocks", "build s", "B/block", *CALLS), rows))


def print_headline(label: str, mine: list[ManagerResult],
                   others: dict[str, list[ManagerResult]], wall_s: float) -> None:
    """Two or three lines: how fast this revision is, and against what."""
    total = sum(r.manager_s for r in mine)
    print(f"\n{label}: {total:.2f} s of manager + hashing over {len(mine)} scenarios "
          f"({wall_s:.0f} s wall),\n  first-admission hit rate "
          f"{min(r.hit_rate for r in mine):.4f}..{max(r.hit_rate for r in mine):.4f}")
    for name, rows in others.items():
        ratios = [a.manager_s / b.manager_s for a, b in zip(mine, rows, strict=True)]
        print(f"  vs {name}: {min(ratios):.2f}x to {max(ratios):.2f}x its time "
              f"({'faster' if max(ratios) < 1 else 'slower' if min(ratios) > 1 else 'mixed'})")
    if not others:
        print("  run with --vs REV (a git revision) or --vllm PYTHON to compare side by side")


if __name__ == "__main__":  # the worker: ``manager.py --worker kvstore|vllm SPECS``
    worker_main(sys.argv[2], sys.argv[3])
