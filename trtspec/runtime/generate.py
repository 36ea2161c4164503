"""`trtspec generate` as a function: engines (or export or HF directories) in, generated text out, in one call."""

from __future__ import annotations

from .generator import Generator


def generate(target, prompt, draft=None, *, drafter: str | None = None, num_draft_tokens: int = 4,
             k_policy: str = "load-aware", tree_width: int = 1, tree_nodes: int | None = None,
             threads: int | None = None, chat: bool = False, system: str | None = None, max_new_tokens: int = 128,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             stop: list[str] | None = None, backend: str = "auto", device: str = "cpu", dtype: str | None = None,
             stream: bool = False, datastore=None):
    """Generate for ``prompt`` (a string -> GenerationResult; a list -> GenerationOutput, with .stats), speculating
    with ``draft``/``drafter`` as Generator does. ``chat``: each prompt is a user's message, put in the model's chat
    template after ``system``. ``backend`` "torch": the directories compiled with torch.compile (trtspec.compile)
    instead of the engines they hold, on ``device`` ("cpu" or "cuda") in ``dtype`` (default: an export's own, else
    float32; "bfloat16" on a GPU). ``stream``: one prompt, and a Stream of its text deltas is returned instead
    (its ``result`` once iterated). ``datastore``: an index (``trtspec index``) suffix decoding drafts from too.
    ``trtspec generate`` is this call."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if system and not chat:
        raise ValueError("system goes with chat (--system with --chat): it is the chat's system message")
    if stream and len(prompts) != 1:
        raise ValueError(f"stream takes one prompt, got {len(prompts)}; stream each, or generate the batch")
    if backend not in ("auto", "torch"):
        raise ValueError(f"unknown backend {backend!r}; choose auto or torch")
    if backend != "torch" and (device != "cpu" or dtype is not None):
        raise ValueError("device and dtype (--device, --dtype) go with backend torch (--backend torch): the engines "
                         "the directories hold run where, and in the type, they were built")
    if backend == "torch":
        target, draft = _torch_engines(target, draft, drafter, tree_width, tree_nodes, device=device, dtype=dtype)
    gen = Generator(target, draft, num_draft_tokens=num_draft_tokens, drafter=drafter, k_policy=k_policy,
                    num_threads=threads, tree_width=tree_width, tree_nodes=tree_nodes, datastore=datastore,
                    max_batch=1 if len(prompts) == 1 else None)  # (one prompt: a session of one row)
    if chat:
        head = [{"role": "system", "content": system}] if system else []
        prompts = [gen.chat_ids([*head, {"role": "user", "content": p}]) for p in prompts]
    options = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                   stop=stop)
    if stream:  # the generator's loop thread ends with the process
        return gen.stream(prompts[0], **options)
    try:
        out = gen.generate(prompts, **options)
    finally:
        gen.close()
    return out[0] if isinstance(prompt, str) else out


def _torch_engines(target, draft, drafter: str | None, tree_width: int, tree_nodes: int | None, *, device: str,
                   dtype: str | None):
    """backend "torch": the target (and a draft model) compiled with torch.compile. A draft head stays the engine it
    was exported as; the target then gets the features it reads, and a tree input where trees are asked for (an
    export directory keeps its own otherwise)."""
    from .. import torch_backend
    from ..manifest import read_manifest

    features = None  # the layers a head reads
    if draft and drafter == "eagle3":
        features = read_manifest(draft)["model"]["target_layers"]
    elif draft and drafter == "medusa":
        features = "last"
    tree = True if tree_width > 1 or tree_nodes or drafter == "medusa" else None
    compiled = torch_backend.compile(target, tree=tree, hidden_states=features, device=device, dtype=dtype)
    if features is not None or not draft:
        return compiled, draft
    return compiled, torch_backend.compile(draft, device=device, dtype=dtype)
