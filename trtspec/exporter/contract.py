"""Names of the step graph's inputs/outputs, and a check that a graph keeps the contract (DESIGN.md §2)."""

from __future__ import annotations

from typing import NamedTuple

from ..errors import ArtifactError


class IONames(NamedTuple):
    inputs: list[str]
    outputs: list[str]
    aliases: dict[str, str]  # present_* output -> the past_* input it overwrites in place


# Tokens one call may carry where a sliding-window layer keeps a ring buffer (its cache then holds
# window + max_call_tokens - 1 slots); the runtime reads longer prompts in chunks of at most this.
DEFAULT_MAX_CALL_TOKENS = 128


def cache_slots(windows, max_seq_len: int, max_call_tokens: int, *, ring_cache: bool = True) -> list[int]:
    """Slots of each layer's KV cache: S_max, or for a sliding-window layer a ring of window + max_call_tokens - 1
    slots where that is smaller (position p lives in slot p mod slots).

    A call writes T <= max_call_tokens consecutive positions ending at e; its first query, at e - T + 1, still
    needs the window before it, so the ring must hold positions [e - T + 1 - window + 1, e]: window + T - 1 slots.
    The same bound keeps rollback exact: rejected positions overwrite only slots older than any later window.
    """
    if not 1 <= max_call_tokens <= max_seq_len:
        raise ValueError(f"max_call_tokens must lie in [1, max_seq_len={max_seq_len}], got {max_call_tokens}")
    ring = [w + max_call_tokens - 1 if ring_cache and w is not None else max_seq_len for w in windows]
    return [min(s, max_seq_len) for s in ring]


def slots_by_input(model: dict) -> dict[str, int]:
    """A manifest's ``model`` section -> {past_* input: its cache slots} (manifests before rings: S_max)."""
    slots = model.get("cache_slots") or [model["max_seq_len"]] * model["num_layers"]
    return {past: slots[int(past.rsplit("_", 1)[1])] for past in model["kv_aliases"].values()}


def max_call_tokens(model: dict) -> int:
    """A manifest's ``model`` section -> the most tokens one call may carry (S_max without rings)."""
    return model.get("max_call_tokens") or model["max_seq_len"]


def io_names(num_layers: int) -> IONames:
    past = [f"past_{kv}_{i}" for i in range(num_layers) for kv in ("key", "value")]
    present = [name.replace("past_", "present_", 1) for name in past]
    return IONames(["input_ids", "position_ids", *past], ["logits", *present], dict(zip(present, past)))


def contract_violations(model, num_layers: int) -> list[str]:
    """Every way an onnx ModelProto breaks the step-graph contract, one line each (empty: it keeps it)."""
    names = io_names(num_layers)
    graph = model.graph
    problems = []
    if [i.name for i in graph.input] != names.inputs:
        problems.append(f"graph inputs are {[i.name for i in graph.input]}, expected {names.inputs}")
    if [o.name for o in graph.output] != names.outputs:
        problems.append(f"graph outputs are {[o.name for o in graph.output]}, expected {names.outputs}")
    consumers: dict[str, list] = {}
    producer = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
        for name in node.output:
            producer[name] = node
    for present, past in names.aliases.items():
        users = consumers.get(past, [])
        scatter = users[0] if len(users) == 1 else None
        if scatter is None or scatter.op_type != "TensorScatter" or scatter.input[0] != past:
            problems.append(f"{past} must feed exactly one TensorScatter (as its cache input), found {[n.op_type for n in users]}")
            continue
        axis = next((a.i for a in scatter.attribute if a.name == "axis"), None)
        if axis != -2:
            problems.append(f"{scatter.name}: TensorScatter axis must be written as -2, found {axis}")
        if producer.get(present) is not scatter:
            problems.append(f"{present} must be the output of {scatter.name} (the in-place update of {past})")
    attention = [n for n in graph.node if n.op_type == "Attention"]
    if len(attention) != num_layers:
        problems.append(f"expected {num_layers} Attention nodes, found {len(attention)}")
    for node in attention:
        if len(node.input) > 4 and any(node.input[4:]):
            problems.append(f"{node.name}: Attention must not take past_key/past_value/nonpad_kv_seqlen inputs")
        if len(node.input) < 4 or not node.input[3]:
            problems.append(f"{node.name}: Attention needs an explicit attn_mask input")
        if len(node.output) > 1 and any(node.output[1:]):
            problems.append(f"{node.name}: Attention must not produce present_key/present_value outputs")
    return problems


def check_step_graph(model, num_layers: int) -> None:
    problems = contract_violations(model, num_layers)
    if problems:
        raise ArtifactError("the graph breaks the step-graph contract:\n  " + "\n  ".join(problems))
