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


# Optional parts of the contract (export options; the manifest's model section records them):
# - input ``tree_mask`` [B, T, T] bool (``tree``): a tree-verify call. Node i of a row sees every cache slot before
#   the call's first write (position_ids[:, 0], the root's position), and of the call's own slots
#   position_ids[:, 0] + j those with tree_mask[:, i, j]: its ancestors and itself. Nodes are in topological order
#   (a parent before its children) and node i's position is the root's plus its depth. A chain's mask is the
#   lower triangle, which gives the plain causal call.
# - output ``hidden_states`` [B, T, len(layers) * hidden] (``hidden_states``): HF's output_hidden_states[i] for
#   each i in the manifest's ``hidden_states.layers`` (the input of layer i; i = num_layers: the last hidden
#   state, after the final norm), concatenated in that order: the target features draft heads read.
TREE_MASK = "tree_mask"
HIDDEN_STATES = "hidden_states"


def io_names(num_layers: int, *, tree: bool = False, hidden_states: bool = False) -> IONames:
    past = [f"past_{kv}_{i}" for i in range(num_layers) for kv in ("key", "value")]
    present = [name.replace("past_", "present_", 1) for name in past]
    inputs = ["input_ids", "position_ids", *([TREE_MASK] if tree else []), *past]
    outputs = ["logits", *([HIDDEN_STATES] if hidden_states else []), *present]
    return IONames(inputs, outputs, dict(zip(present, past)))


def contract_options(model: dict) -> dict:
    """A manifest's ``model`` section -> the optional parts its graph has (io_names' keyword arguments)."""
    return {"tree": bool(model.get("tree_verify")), "hidden_states": bool(model.get("hidden_states"))}


def parse_hidden_states(value, num_layers: int) -> list[int]:
    """``hidden_states`` as given to export ("low,mid,high", "last", or layer indices) -> HF hidden_states indices.

    low/mid/high are the layers EAGLE-3 reads (2, L // 2, L - 3, as its authors' code picks them; for models too
    shallow for three distinct ones, L // 6, L // 2, L - 1); "last" is index L, the final-normed state Medusa
    heads read."""
    if value is None or value == "" or value == []:
        return []
    low, mid, high = 2, num_layers // 2, num_layers - 3
    if not 0 <= low < mid < high:  # a shallow model: spread them instead (6 layers: 1, 3, 5)
        low, mid, high = min(max(1, num_layers // 6), num_layers), num_layers // 2, max(num_layers - 1, 0)
    names = {"low": low, "mid": mid, "high": high, "last": num_layers}
    items = value.split(",") if isinstance(value, str) else list(value)
    layers = []
    for item in items:
        item = item.strip() if isinstance(item, str) else item
        if isinstance(item, str) and item in names:
            layers.append(names[item])
        else:
            try:
                index = int(item)
            except (TypeError, ValueError):
                raise ValueError(f"hidden_states: {item!r} is neither low, mid, high, last nor a layer index") from None
            if not 0 <= index <= num_layers:
                raise ValueError(f"hidden_states: layer index {index} outside [0, {num_layers}] (the model has "
                                 f"{num_layers} layers; {num_layers} is the last hidden state)")
            layers.append(index)
    return layers


def contract_violations(model, num_layers: int, *, tree: bool = False, hidden_states: bool = False) -> list[str]:
    """Every way an onnx ModelProto breaks the step-graph contract, one line each (empty: it keeps it)."""
    names = io_names(num_layers, tree=tree, hidden_states=hidden_states)
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


def check_step_graph(model, num_layers: int, *, tree: bool = False, hidden_states: bool = False) -> None:
    problems = contract_violations(model, num_layers, tree=tree, hidden_states=hidden_states)
    if problems:
        raise ArtifactError("the graph breaks the step-graph contract:\n  " + "\n  ".join(problems))
