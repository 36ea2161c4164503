"""Which profile of a TensorRT plan runs a call: here in engines because the runtime picks one per call, while the builder only writes the plan."""

from __future__ import annotations

from ..errors import CapacityError


def select_profile(plan: dict, batch: int, tokens: int) -> int:
    """The index of the profile (= execution context) that runs a [batch, tokens] call."""
    if batch > plan["max_batch"]:
        raise CapacityError(
            f"batch of {batch} rows but the engine was built for {plan['max_batch']}; rebuild with a larger export --max-batch"
        )
    for index, profile in enumerate(plan["profiles"]):
        if profile["tokens"] == tokens:
            return index
    if tokens <= plan["max_prefill"]:
        return 0
    raise CapacityError(
        f"a call of {tokens} tokens per row exceeds the engine's prefill profile ({plan['max_prefill']} tokens) "
        f"and matches no verify profile {plan['verify_tokens']}; rebuild with --max-prefill {tokens}"
    )


def is_static(profile: dict) -> bool:
    """Decode and verify profiles have one T, so a CUDA graph per batch size replays them."""
    return profile["tokens"] is not None
