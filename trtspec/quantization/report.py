"""What a quantization pass changed: one entry per MatMul it considered, quantized or skipped and why."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Entry:
    name: str  # the MatMul's module, e.g. layers.0.self_attn.q_proj
    shape: tuple[int, int]  # weight [K, N]
    action: str  # "quantized" | "skipped"
    detail: str  # format and layout, or the reason it was skipped
    bytes_before: int
    bytes_after: int


@dataclass
class QuantizationReport:
    mode: str
    entries: list[Entry] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # graph-level changes: smoothing folds, Q/DQ on activations

    def quantized(self) -> list[Entry]:
        return [e for e in self.entries if e.action == "quantized"]

    def skipped(self) -> list[Entry]:
        return [e for e in self.entries if e.action == "skipped"]

    def entry(self, name: str) -> Entry:
        return next(e for e in self.entries if e.name == name)

    def update(self, name: str, **changes) -> None:
        entry = self.entry(name)
        for key, value in changes.items():
            setattr(entry, key, value)

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "summary": self.summary(),
            "entries": [asdict(e) for e in self.entries],
            "notes": self.notes,
        }

    def summary(self) -> dict:
        return {
            "quantized": len(self.quantized()),
            "skipped": len(self.skipped()),
            "matmul_weight_bytes_before": sum(e.bytes_before for e in self.entries),
            "matmul_weight_bytes_after": sum(e.bytes_after for e in self.entries),
        }

    def format(self) -> str:
        s = self.summary()
        lines = [f"{self.mode}: {s['quantized']} MatMuls quantized, {s['skipped']} skipped; MatMul weights "
                 f"{s['matmul_weight_bytes_before'] / 1e6:.2f} MB -> {s['matmul_weight_bytes_after'] / 1e6:.2f} MB"]
        lines += [f"  skipped {e.name}{f' {list(e.shape)}' if any(e.shape) else ''}: {e.detail}" for e in self.skipped()]
        return "\n".join(lines)
