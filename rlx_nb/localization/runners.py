"""How a standalone repro runs its program on each backend: the source it writes, importing only torch, numpy and
the runtime under test.

Each runner is the text of ``def on_backend(fn, weights, inputs)``: ``fn(*weights, *inputs)`` is the program (the
culprit op or module as the model ran it); it returns the program's outputs as the backend computes them.  The
runners do what rlx_nb's own backends do (the same exporter route, the same session options, the same precision
hint), written out so that a maintainer can read and run them.
"""

from __future__ import annotations

import dataclasses

from rlx_nb.errors import InputError


@dataclasses.dataclass(frozen=True)
class Runner:
    """The imports and the ``on_backend`` source of one backend; ``module``: whether it needs the program as a
    module with its weights as the module's own (an exporter keeps those as constants, as it did in the model)."""

    imports: str
    source: str
    module: bool = False
    differentiable: bool = False


_EAGER = "def on_backend(fn, weights, inputs):  # {what}\n    {setup}return fn(*weights, *inputs)\n"

_PROGRAM = """\
class Program(torch.nn.Module):  # the program, its weights the module's own (as they were in the model)
    def __init__(self, fn, weights):
        super().__init__()
        self.fn, self.names = fn, [f"w{i}" for i in range(len(weights))]
        for name, w in zip(self.names, weights):
            self.register_buffer(name, w)

    def forward(self, *inputs):
        return self.fn(*(getattr(self, n) for n in self.names), *inputs)

"""


def _eager(what: str, setup: str = "") -> Runner:
    return Runner("", _EAGER.format(what=what, setup=setup), differentiable=True)


def _cuda(what: str, tf32: bool, autocast: str = "") -> Runner:
    setup = (
        f"torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = {tf32}\n"
        "    moved = [t.cuda() for t in (*weights, *inputs)]\n"
    )
    body = "    return fn(*moved)\n"
    if autocast:
        body = f"    with torch.autocast('cuda', dtype=torch.{autocast}):\n        return fn(*moved)\n"
    return Runner("", f"def on_backend(fn, weights, inputs):  # {what}\n    {setup}{body}", differentiable=True)


def _inductor(device: str) -> Runner:
    move = "" if device == "cpu" else "    weights, inputs = [t.cuda() for t in weights], [t.cuda() for t in inputs]\n"
    source = (
        f"def on_backend(fn, weights, inputs):  # torch.compile (Inductor) on the {device.upper()}\n"
        f"{move}    torch._dynamo.reset()\n"
        "    return torch.compile(fn, fullgraph=True)(*weights, *inputs)\n"
    )
    return Runner("", source, differentiable=True)


_ONNX = """\
def on_backend(fn, weights, inputs):  # torch.onnx.export, then ONNX Runtime on the CPU{what}
    path, program = os.path.join(tempfile.mkdtemp(), "program.onnx"), Program(fn, weights).eval()
    try:  # (the TorchScript exporter first, as rlx_nb did, then the dynamo one)
        with contextlib.redirect_stdout(io.StringIO()):  # (a graph it cannot export, printed whole)
            torch.onnx.export(program, tuple(inputs), path, dynamo=False)
    except Exception:
        torch.onnx.export(program, tuple(inputs), path, dynamo=True, external_data=False, verbose=False)
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.{level}
    session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    feed = {{i.name: x.numpy() for i, x in zip(session.get_inputs(), inputs)}}
    return tuple(torch.from_numpy(o) for o in session.run(None, feed))
"""

_OPENVINO = """\
def on_backend(fn, weights, inputs):  # OpenVINO's CPU plugin, {what}
    model = openvino.convert_model(Program(fn, weights).eval(), example_input=tuple(inputs))
    compiled = openvino.Core().compile_model(model, "CPU", {config})
    result = compiled([x.numpy() for x in inputs])
    return tuple(torch.from_numpy(result[o]) for o in compiled.outputs)
"""

_EXECUTORCH = """\
def on_backend(fn, weights, inputs):  # torch.export, ExecuTorch lowering{what}, ExecuTorch's runtime
    with sdpa_kernel(SDPBackend.MATH):  # (attention traced as the lowering decomposes it: its layouts agree)
        exported = torch.export.export(Program(fn, weights).eval(), tuple(inputs), strict=False)
        program = to_edge_transform_and_lower(exported, partitioner=[{partitioner}]).to_executorch()
    method = Runtime.get().load_program(program.buffer).load_method("forward")
    return tuple(method.execute([x.contiguous() for x in inputs]))
"""

_LITERT = """\
def on_backend(fn, weights, inputs):  # litert_torch.convert, then LiteRT's interpreter ({what})
    path = os.path.join(tempfile.mkdtemp(), "program.tflite")
    with contextlib.redirect_stdout(io.StringIO()):  # (the converter's progress lines)
        litert_torch.convert(Program(fn, weights).eval(), tuple(inputs)).export(path)
    interpreter = Interpreter(model_path=path, experimental_op_resolver_type=OpResolverType.{resolver})
    run = interpreter.get_signature_runner()
    feed = {{n: x.numpy().astype(d["dtype"]) for (n, d), x in zip(run.get_input_details().items(), inputs)}}
    out = run(**feed)
    return tuple(torch.from_numpy(np.array(out[k])) for k in sorted(out, key=lambda k: int(k.rpartition("_")[2])))
"""

_EXECUTORCH_IMPORTS = (
    "from executorch.exir import to_edge_transform_and_lower\nfrom executorch.runtime import Runtime\n"
    "from torch.nn.attention import SDPBackend, sdpa_kernel\n"
)

RUNNERS: dict[str, Runner] = {
    "eager": _eager("the backend's own computation, as torch.export traced it, run eagerly"),
    "cpu-nomkldnn": _eager(
        "eager, oneDNN off", "with torch.backends.mkldnn.flags(enabled=False):\n        "
    ),
    "cpu-bf16": _eager("autocast to bfloat16", "with torch.autocast('cpu', dtype=torch.bfloat16):\n        "),
    "cpu-fp16": _eager("autocast to float16", "with torch.autocast('cpu', dtype=torch.float16):\n        "),
    "cpu-inductor": _inductor("cpu"),
    "cuda-inductor": _inductor("cuda"),
    "cuda": _cuda("CUDA, TF32 off", False),
    "cuda-tf32": _cuda("CUDA, TF32 on", True),
    "cuda-bf16": _cuda("CUDA, autocast to bfloat16", False, "bfloat16"),
    "onnxruntime": Runner("import contextlib\nimport io\nimport os\nimport tempfile\nimport onnxruntime\n",
                          _ONNX.format(what=", every graph optimization on", level="ORT_ENABLE_ALL"), module=True),
    "onnxruntime-noopt": Runner("import contextlib\nimport io\nimport os\nimport tempfile\nimport onnxruntime\n",
                                _ONNX.format(what=", graph optimizations off", level="ORT_DISABLE_ALL"), module=True),
    "openvino": Runner("import openvino\n", _OPENVINO.format(what="float32 (INFERENCE_PRECISION_HINT=f32)",
                                                            config='{"INFERENCE_PRECISION_HINT": "f32"}'), module=True),
    "openvino-default": Runner("import openvino\n", _OPENVINO.format(what="its default settings", config="{}"),
                               module=True),
    "executorch-xnnpack": Runner(
        _EXECUTORCH_IMPORTS + "from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner\n",
        _EXECUTORCH.format(what=" to XNNPACK", partitioner="XnnpackPartitioner()"), module=True),
    "executorch-portable": Runner(_EXECUTORCH_IMPORTS, _EXECUTORCH.format(what=" (portable kernels)", partitioner=""),
                                  module=True),
    "litert": Runner(
        "import contextlib\nimport io\nimport os\nimport tempfile\nimport numpy as np\nimport litert_torch\nfrom ai_edge_litert.interpreter import Interpreter, OpResolverType\n",
        _LITERT.format(what="XNNPACK delegate", resolver="AUTO"), module=True),
    "litert-reference": Runner(
        "import contextlib\nimport io\nimport os\nimport tempfile\nimport numpy as np\nimport litert_torch\nfrom ai_edge_litert.interpreter import Interpreter, OpResolverType\n",
        _LITERT.format(what="reference kernels", resolver="BUILTIN_REF"), module=True),
}  # fmt: skip
"""The runners by backend name; ``eager`` runs a program that carries the backend's own computation (a fault, a
registered function), as traced."""

PAIRS: dict[str, tuple[str, str]] = {
    "executorch-xnnpack": ("executorch-portable", "the delegate (XNNPACK)"),
    "executorch-portable": ("executorch-xnnpack", "the portable kernels"),
    "litert": ("litert-reference", "the delegate (XNNPACK)"),
    "litert-reference": ("litert", "the reference kernels"),
    "onnxruntime": ("onnxruntime-noopt", "the graph optimizer"),
    "onnxruntime-noopt": ("onnxruntime", "the kernels"),
}
"""Each runtime's other member of its pair, and what is the fast path's own when only the fast path diverges."""


def runtime_of(backend: str) -> tuple[str, bool]:
    """``(the runner's name, whether the program the runner is given carries the backend's own computation)``:
    a catalogue fault carried through a runtime (``onnxruntime+softmax-row``) is the runtime given the faulty
    program; a fault or a registered backend with no runner of its own is its traced computation run eagerly."""
    if backend in RUNNERS and backend != "eager":
        return backend, False
    runtime, plus, _ = backend.partition("+")
    if plus and runtime in RUNNERS:
        return runtime, True
    return "eager", True


def runner_source(name: str) -> tuple[str, str]:
    """``(imports, definitions)`` of the runner ``name`` (the Program module first where it needs one)."""
    if name not in RUNNERS:
        raise InputError(f"no standalone runner for {name!r}; runners: {', '.join(RUNNERS)}")
    r = RUNNERS[name]
    return r.imports, (_PROGRAM if r.module else "") + r.source


__all__ = ["PAIRS", "RUNNERS", "Runner", "runner_source", "runtime_of"]
