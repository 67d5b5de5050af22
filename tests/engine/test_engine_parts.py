"""The engine in parts: the layering (scheduler -> plans <- runner, the engine joining them, no
import cycle in asyncrl/engine) and the scheduler alone, on plain values and without a model:
admission under the token budget, prefix donors, compaction."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

from asyncrl.engine.plans import DecodePlan, Drawn, Prefill, PrefillRound
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.scheduler import SHORTEST_BUCKET, Scheduler, length_bucket
from asyncrl.engine.types import GenerationRequest

ENGINE = Path(__file__).resolve().parents[2] / "asyncrl" / "engine"
STOP = 2
SYSTEM = list(range(10, 22))  # a 12-token shared prefix: longer than MIN_SHARED_PREFIX


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports anywhere (module level, functions, TYPE_CHECKING blocks);
    ``from package import name`` counts as ``package.name`` too, since name may be a module."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def _engine_graph() -> dict[str, set[str]]:
    """asyncrl.engine module -> the asyncrl.engine modules it imports."""
    modules = {f"asyncrl.engine.{p.stem}" for p in ENGINE.glob("*.py") if p.stem != "__init__"}
    return {
        f"asyncrl.engine.{p.stem}": _imports(p) & modules for p in ENGINE.glob("*.py") if p.stem != "__init__"
    }


def test_the_engine_modules_import_each_other_without_a_cycle() -> None:
    graph = _engine_graph()
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for dep in sorted(graph[module]):
            assert state.get(dep) != "open", f"import cycle: {' -> '.join([*path, dep])}"
            if dep not in state:
                visit(dep, [*path, dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    # One way: the engine joins the parts, the runner executes plans, the scheduler writes them.
    assert {"asyncrl.engine.scheduler", "asyncrl.engine.runner"} <= graph["asyncrl.engine.embedded"]
    assert "asyncrl.engine.plans" in graph["asyncrl.engine.runner"] & graph["asyncrl.engine.scheduler"]
    assert not graph["asyncrl.engine.runner"] & {"asyncrl.engine.scheduler", "asyncrl.engine.embedded"}
    assert not graph["asyncrl.engine.plans"] & {
        "asyncrl.engine.scheduler",
        "asyncrl.engine.runner",
        "asyncrl.engine.embedded",
    }


def test_the_scheduler_never_sees_the_engine_the_model_or_a_tensor() -> None:
    path = ENGINE / "scheduler.py"
    forbidden = ("asyncrl.engine.embedded", "asyncrl.engine.runner", "asyncrl.engine.graphs")
    forbidden += ("asyncrl.engine.kv_cache", "asyncrl.models", "torch", "transformers")
    for module in _imports(path):
        assert not module.startswith(forbidden), f"scheduler.py imports {module}"
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.arg):
            names = [node.arg, ast.unparse(node.annotation) if node.annotation else ""]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.FunctionDef) and node.returns is not None:
            names = [ast.unparse(node.returns)]
        for name in names:
            assert "engine" not in name.lower() and "runner" not in name.lower(), name


def request(rid: str, ids: list[int], budget: int) -> GenerationRequest:
    return GenerationRequest(rid, ids, SamplingParams(budget, stop_token_ids=(STOP,)), seed=7)


def scheduler(
    *requests: GenerationRequest, slots: int = 8, static: bool = False, budget=None, slot_len: int = 64
) -> Scheduler:
    out = Scheduler(slots, slot_len, max_tokens_in_flight=budget, static=static)
    out.waiting += requests
    return out


def draw(s: Scheduler, tokens: dict[int, int]) -> list[str]:
    """One draw in which the row of slot ``k`` samples ``tokens[k]`` (5 if not given); returns
    the ids of the rows that finished."""
    plan = s.schedule_draw()
    drawn = Drawn([tokens.get(slot, 5) for slot in plan.slots], [0.0] * len(plan.slots), None)
    return [r.request_id for r in s.postprocess(plan, drawn, None)]


def test_admission_stops_at_the_token_budget_and_the_free_slots() -> None:
    reqs = [request(f"r{k}", [3 + k, 4, 5, 6, 7], 10) for k in range(3)]  # 15 tokens reserved each
    s = scheduler(*reqs, budget=30)
    plan = s.admit(version=0, weights_epoch=0)
    assert [slot for slot, _, _ in plan.sampling] == [0, 1]  # the third would exceed 30
    assert (s.num_running, len(s.waiting), s.tokens_in_flight(), s.admissible()) == (2, 1, 30, 0)
    assert s.admit(version=0, weights_epoch=0) is None
    assert draw(s, {0: STOP}) == ["r0"]
    assert s.admissible() == 1
    assert s.admit(version=0, weights_epoch=0).sampling[0][0] == 0  # the lowest free slot
    full = scheduler(*reqs, slots=2)
    full.admit(version=0, weights_epoch=0)
    assert (full.num_running, len(full.waiting)) == (2, 1)


def test_identical_contexts_are_prefilled_once_and_shared_prefixes_copied_from_a_newcomer() -> None:
    a, twin = request("a", [*SYSTEM, 1, 2], 4), request("twin", [*SYSTEM, 1, 2], 4)
    shares, alone = request("shares", [*SYSTEM, 3], 4), request("alone", [5, 6, 7], 4)
    s = scheduler(a, twin, shares, alone)
    plan = s.admit(version=3, weights_epoch=0)
    assert plan.rounds == [
        PrefillRound([Prefill(0, [*SYSTEM, 1, 2], 0, None), Prefill(3, [5, 6, 7], 0, None)], length=14),
        PrefillRound([Prefill(2, [3], 12, 0)], length=13),  # after its source, slot 0
    ]
    assert plan.twins == [(0, 1, 14)]
    assert (plan.prefill_tokens, plan.reused_tokens) == (18, 12 + 14)
    assert s.lengths[:5] == [14, 14, 13, 3, 0]
    assert {row.logits_version for row in s.running()} == {3}


def test_shared_prefixes_are_copied_from_running_rows_of_the_current_weights_only() -> None:
    s = scheduler(request("a", [*SYSTEM, 1, 2], 4), request("shares", [*SYSTEM, 3], 4))
    s.admit(version=0, weights_epoch=0)
    draw(s, {})
    s.schedule_decode(refill=False, version=0)  # slot 0 now caches SYSTEM + [1, 2, 5]
    late = request("late", [*SYSTEM, 1, 2, 5, 8], 4)
    stale = copy.deepcopy(s)
    s.waiting.append(late)
    assert s.admit(version=0, weights_epoch=0).rounds == [PrefillRound([Prefill(2, [8], 15, 0)], length=16)]
    stale.waiting.append(late)  # the running rows' caches were computed before a weight load
    assert stale.admit(version=1, weights_epoch=1).rounds == [
        PrefillRound([Prefill(2, late.prompt_ids, 0, None)], length=16)
    ]


def test_cpu_compaction_moves_the_highest_rows_into_holes_the_next_admission_leaves() -> None:
    reqs = [request(f"r{k}", [3 + k] * (2 + k), 8) for k in range(4)]
    s = scheduler(*reqs, slots=4)
    s.admit(version=0, weights_epoch=0)
    refilled = copy.deepcopy(s)
    assert draw(s, {0: STOP, 2: STOP}) == ["r0", "r2"]
    # Two holes below slot 3: the highest row moves into the lowest; slot 1 stays.
    assert s.schedule_decode(refill=False, version=1) == DecodePlan(
        moves=[(3, 0, 5)], tokens={1: 5, 0: 5}, rows=2, starts=[5, 3], length=6
    )
    assert s.lengths[:4] == [6, 4, 0, 0] and s.rows[0].request.request_id == "r3"
    assert s.rows[0].logits_version == 1
    # With one request waiting to be admitted, the lowest hole is left for it.
    refilled.waiting.append(request("next", [9, 9], 4))
    draw(refilled, {0: STOP, 2: STOP})
    plan = refilled.schedule_decode(refill=True, version=0)
    assert (plan.moves, plan.rows, plan.tokens) == ([(3, 2, 5)], 3, {1: 5, 2: 5})


def test_accelerator_compaction_moves_rows_only_when_the_batch_drops_a_bucket() -> None:
    reqs = [request(f"r{k}", [3 + k] * 3, 8) for k in range(6)]
    s = scheduler(*reqs, static=True)
    s.admit(version=0, weights_epoch=0)
    assert s.schedule_draw().rows == 8  # slots 0..5: the bucket of 8
    draw(s, {0: STOP})
    plan = s.schedule_decode(refill=False, version=0)  # five rows need the bucket of 8 still
    assert (plan.moves, plan.rows, plan.length) == ([], 8, 64)
    draw(s, {1: STOP, 2: STOP})
    plan = s.schedule_decode(refill=False, version=0)  # three rows fit the bucket of 4
    assert (plan.moves, plan.rows, plan.length) == ([(4, 0, 4), (5, 1, 4)], 4, 64)
    assert [r.request.request_id for r in s.running()] == ["r4", "r5", "r3"]


def test_accelerator_decode_attends_over_a_length_bucket_not_the_whole_slot() -> None:
    """Every decode length's bucket holds it, wastes under a fifth of its columns past the
    shortest bucket, never exceeds the slot, and a long slot has few buckets (graphs)."""
    slot = 32768
    buckets = [length_bucket(n, slot) for n in range(1, slot + 1)]
    assert buckets == sorted(buckets)
    assert all(n <= b <= slot for n, b in zip(range(1, slot + 1), buckets, strict=True))
    assert max((b - n) / b for n, b in enumerate(buckets, start=1) if n > SHORTEST_BUCKET) < 0.2
    assert len(set(buckets)) == 1 + 4 * 7  # 256, then four per doubling up to 32768
    assert set(buckets[:SHORTEST_BUCKET]) == {SHORTEST_BUCKET}
    assert [length_bucket(n, 600) for n in (10, 300, 513, 599)] == [256, 320, 600, 600]
    assert length_bucket(10, 100) == 100  # a slot shorter than the shortest bucket
    s = scheduler(*[request(f"r{k}", [3 + k] * (300 + k), 4) for k in range(2)], static=True, slot_len=1024)
    s.admit(version=0, weights_epoch=0)
    draw(s, {})
    assert s.schedule_decode(refill=False, version=0).length == 320  # longest row: 302 tokens


def test_abort_returns_waiting_then_running_requests_and_frees_their_slots() -> None:
    s = scheduler(*[request(f"r{k}", [3, 4], 6) for k in range(3)], slots=2)
    s.admit(version=0, weights_epoch=0)
    draw(s, {})
    out = s.abort({"r2", "r1"})
    assert [(r.request_id, r.completion_ids, r.finish_reason) for r in out] == [
        ("r2", [], "abort"),
        ("r1", [5], "abort"),
    ]
    assert (s.num_running, s.waiting, s.rows[1], s.lengths[1]) == (1, [], None, 0)
