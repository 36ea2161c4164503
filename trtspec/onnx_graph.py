"""Read-only indexes of an ONNX ModelProto for the static checks (TensorRT support, Q/DQ rules)."""

from __future__ import annotations

from onnx import helper


class GraphIndex:
    """Indexes of one graph: producers, initializers, constants, value types."""

    def __init__(self, model, base_dir=None):
        """``base_dir``: the directory of the model's file, where initializers stored as external data are
        read from (a model loaded with ``load_external_data=False``)."""
        graph = model.graph
        self.graph = graph
        self.inputs = {i.name: i for i in graph.input}
        self.outputs = {o.name for o in graph.output}
        self.initializers = {i.name: i for i in graph.initializer}
        self.producer = {out: node for node in graph.node for out in node.output}
        self.consumers: dict[str, list] = {}
        for node in graph.node:
            for name in node.input:
                if name:
                    self.consumers.setdefault(name, []).append(node)
        self.constants = {n.output[0]: n for n in graph.node if n.op_type == "Constant"}
        self.types = {v.name: v.type for v in [*graph.value_info, *graph.input, *graph.output]}
        self._model = model
        self._base_dir = str(base_dir) if base_dir is not None else ""
        self._inferred = False

    def tensor_type(self, name: str):
        if name not in self.types and not self._inferred:
            # Shape inference needs no weights: it runs on a model loaded without external data.
            import onnx

            inferred = onnx.shape_inference.infer_shapes(self._model)
            self.types.update({v.name: v.type for v in inferred.graph.value_info})
            self._inferred = True
        return self.types[name].tensor_type if name in self.types else None

    def constant(self, name: str):
        """The TensorProto of a constant initializer or Constant node output; None when computed at run time."""
        if name in self.initializers:
            return self.initializers[name]
        node = self.constants.get(name)
        if node is not None:
            return next((a.t for a in node.attribute if a.name == "value"), None)
        return None

    def array(self, tensor):
        """A constant's values as numpy, read from the external data file when stored there."""
        from onnx import numpy_helper

        return numpy_helper.to_array(tensor, self._base_dir)

    def describe(self, name: str) -> str:
        node = self.producer.get(name)
        return f"{node.op_type} node {node.name!r}" if node is not None else "no node (a computed value)"


def dims(tensor_type) -> list | None:
    if tensor_type is None or not tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tensor_type.shape.dim]


def attr(node, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default
