"""The encoder's forward pass in int8: the transformers model exported to ONNX, its linear layers quantised,
run by ONNX Runtime (`TextEncoder(precision="int8")`, `--encoder-precision int8`).

Why: a rollout spends most of its time in the encoder (benchmarks/results/rollout_speed.md), and a CPU with
int8 dot-product instructions (AVX512-VNNI, AVX-VNNI) multiplies int8 matrices about twice as fast as bf16
ones. Dynamic quantisation: the weights are quantised once, per output channel; each matrix product's input
is quantised on the fly, one scale per tensor.

Why not every layer: one activation scale per tensor is coarse where a few channels are much larger than the
rest (the input of a feed-forward block's down-projection), and the error of an early layer is carried through
all the later ones. Quantising every linear layer of all-MiniLM-L6-v2 left vectors at cosine 0.984 to fp32's at
worst on real logs' turns; keeping the first layer and the down-projections of the second and third in fp32
(28% of the matrix products' work) raised that to 0.990 (0.996 on average).
So that a model other than MiniLM cannot silently stray further, `Int8Encoder` checks its vectors against fp32
on `PROBE_TEXTS` when it is built and refuses below `MIN_COSINE`.

Each text goes through the model on its own (`Int8Encoder` tokenizes it alone): with one activation scale
per tensor, a text's int8 vector would otherwise depend on the texts padded beside it. Without padding this
costs nothing measurable, and the export is traced on one unpadded text (its attention mask all ones), which
is what it is then given.

The quantised model is built in memory from the loaded model (~3 s on 2 cores), so tuned top layers are part
of it, and nothing is written outside a temporary folder. A process builds it once per model (`shared_int8`):
the policies and evaluations of one process (a benchmark, the demo, a test session) share it.

Needs ONNX Runtime and onnx, dependencies of offline-agent (an install without them runs "auto" in bf16 or
fp32, and refuses "int8" with what to install).
"""

from __future__ import annotations

import logging
import re
import tempfile
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from offline_agent.errors import UserError, first_line

#: The smallest cosine of an int8 vector to the fp32 one on PROBE_TEXTS that `Int8Encoder` accepts.
MIN_COSINE = 0.99

#: Texts of the kinds a state holds (a task, a tool call, a tool's output, an error, a reply), encoded in fp32
#: and in int8 when the int8 model is built.
PROBE_TEXTS = (
    "Task: Rebook my flight from JFK to SFO on the 14th and keep my seat upgrade.",
    '[act] call search_flights {"origin": "JFK", "destination": "SFO", "date": "2024-05-14"}',
    '[obs] {"flights": [{"id": "HAT123", "departure": "08:15", "seats_left": 3, "price": 412.0}]}',
    "[obs] Traceback (most recent call last): KeyError: 'reservation_id' in update_booking",
    "[act] SELECT name, COUNT(*) FROM orders JOIN customers USING (customer_id) GROUP BY name;",
    "[obs] ls: cannot access '/var/log/app': No such file or directory",
    "[act] reply I have moved you to the 08:15 flight; your upgrade is kept.",
    "[obs] done",
)

# The first number after a dot in an exported node's name is its transformer layer ("/m/encoder/layer.0/...").
_LAYER = re.compile(r"\.(\d+)/")


def require_onnxruntime() -> None:
    """A UserError that says what to install when onnxruntime or onnx is missing."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        raise UserError(
            f"--encoder-precision int8 runs the encoder with ONNX Runtime, which is not installed ({exc.name}): "
            "`pip install onnxruntime onnx` (dependencies of offline-agent), or use --encoder-precision bf16 or fp32"
        ) from None


#: Int8 models built in this process, by key (`shared_int8`); the oldest goes first past KEEP_BUILT, since each
#: holds a copy of its model's weights (~30 MB for MiniLM).
_BUILT: OrderedDict[Hashable, Int8Encoder] = OrderedDict()
KEEP_BUILT = 2


def shared_int8(key: Hashable, model: Any, tokenizer: Any, max_length: int, pool: Any) -> Int8Encoder:
    """The int8 model of `model`, built on the first call with its `key` (the model's folder and id: the same
    weights, tuned layers and max_length) and shared by later ones, each of which it checks against
    MIN_COSINE again."""
    built = _BUILT.get(key)
    if built is None:
        built = _BUILT[key] = Int8Encoder(model, tokenizer, max_length, pool)
    else:
        built.check()
        _BUILT.move_to_end(key)
    while len(_BUILT) > KEEP_BUILT:
        _BUILT.popitem(last=False)
    return built


def layers_kept_in_fp32(model_proto: Any) -> list[str]:
    """Names of the MatMul nodes of an exported encoder that stay in fp32: every one of the first transformer
    layer, and the down-projections of the second and third (a weight with more input than output features:
    a feed-forward block's second matrix)."""
    from onnx import numpy_helper

    shapes = {init.name: numpy_helper.to_array(init).shape for init in model_proto.graph.initializer}
    kept = []
    for node in model_proto.graph.node:
        layer = _LAYER.search(node.name)
        if node.op_type != "MatMul" or layer is None:
            continue
        weight = shapes.get(node.input[1])
        index = int(layer.group(1))
        if index == 0 or (index in (1, 2) and weight is not None and weight[0] > weight[1]):
            kept.append(node.name)
    return kept


def _last_hidden(model: Any, names: list[str]) -> Any:
    """The model as a module of its tokenizer's tensors, in the order `names`, to its last hidden state: what
    the exporter traces."""
    import torch

    class LastHidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, *tensors: Any) -> Any:
            return self.m(**dict(zip(names, tensors, strict=True))).last_hidden_state

    return LastHidden().eval()


class Int8Encoder:
    """The int8 model of a loaded transformers encoder: `encode(texts)` gives (N, D) float32 unit vectors, mean
    pooled as `TextEncoder` pools (`pool`, checked against it on PROBE_TEXTS when built).

    Each text is tokenized alone (no padding; see the module docstring), and as many texts go through the
    model at once as torch has threads (`torch.set_num_threads`), each on one thread: a pass over one ~40-token
    text is too small to split over threads (on 2 cores, two texts at once encode 1.6x as fast as one text on
    two threads)."""

    def __init__(self, model: Any, tokenizer: Any, max_length: int, pool: Any):
        import torch

        require_onnxruntime()
        self.tokenizer, self.max_length, self.dim = tokenizer, max_length, int(model.config.hidden_size)
        self._pool: tuple[int, ThreadPoolExecutor] | None = None  # (workers, pool), made for torch's threads
        example = tokenizer([PROBE_TEXTS[0]], return_tensors="pt")
        self.names = [name for name in tokenizer.model_input_names if name in example]
        try:
            self.session = _quantised_session(model, [example[n] for n in self.names], self.names)
        except Exception as exc:  # the exporter's and the quantiser's errors, on a model they cannot handle
            raise UserError(
                f"this encoder cannot be quantised to int8 with ONNX Runtime ({first_line(exc)}): use "
                "--encoder-precision bf16 or fp32"
            ) from exc
        with torch.inference_mode():
            fp32 = []
            for text in PROBE_TEXTS:
                probe = tokenizer([text], truncation=True, max_length=max_length, return_tensors="pt")
                fp32.append(pool(model(**probe).last_hidden_state.float(), probe["attention_mask"])[0].numpy())
        self.probe_cosine = float((np.stack(fp32) * self.encode(PROBE_TEXTS)).sum(1).min())
        self.check()

    def check(self) -> None:
        """A UserError if this model's vectors stray from fp32's on PROBE_TEXTS by more than MIN_COSINE allows."""
        if self.probe_cosine < MIN_COSINE:
            raise UserError(
                f"this encoder's int8 vectors stray from its fp32 ones (cosine {self.probe_cosine:.4f} < "
                f"{MIN_COSINE} on probe texts): use --encoder-precision bf16 or fp32"
            )

    def encode(self, texts: Sequence[str], advance: Callable[[int], None] = lambda n: None) -> np.ndarray:
        """(N, D) float32 unit vectors of `texts`, in order; `advance(1)` after each."""
        import torch

        out = np.empty((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        tokens = self.tokenizer(list(texts), truncation=True, max_length=self.max_length)  # one call, unpadded

        def one(i: int) -> np.ndarray:
            feed = {name: np.asarray([tokens[name][i]], dtype=np.int64) for name in self.names}
            hidden = self.session.run(None, feed)[0][0]  # (T, D): no padding, so the mean over all tokens
            pooled = hidden.mean(0)
            return pooled / max(float(np.linalg.norm(pooled)), 1e-12)

        # One text (a single environment's step) runs here: handing it to a thread only adds the hand-off.
        workers = torch.get_num_threads() if len(texts) > 1 else 1
        if workers > 1 and (self._pool is None or self._pool[0] != workers):
            if self._pool is not None:
                self._pool[1].shutdown()
            self._pool = (workers, ThreadPoolExecutor(workers, thread_name_prefix="int8-encoder"))
        vectors = map(one, range(len(texts))) if workers == 1 else self._pool[1].map(one, range(len(texts)))
        for i, vector in enumerate(vectors):
            out[i] = vector
            advance(1)
        return out


def _quantised_session(model: Any, example: list[Any], names: list[str]) -> Any:
    """An ONNX Runtime session of `model` (a traced export at `example`, batch and length dynamic) with its
    linear layers quantised to int8 but `layers_kept_in_fp32`."""
    import onnx
    import onnxruntime as ort
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic

    axes = {name: {0: "batch", 1: "tokens"} for name in [*names, "hidden"]}
    with tempfile.TemporaryDirectory(prefix="offline-agent-int8-") as tmp, warnings.catch_warnings():
        # The tracer warns about Python branches on shapes that are fixed for an encoder (no causal mask).
        warnings.simplefilter("ignore")
        exported, quantised = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        torch.onnx.export(
            _last_hidden(model, names), tuple(example), str(exported), input_names=names,
            output_names=["hidden"], dynamic_axes=axes, opset_version=17, dynamo=False,
        )
        before = logging.root.manager.disable
        logging.disable(logging.WARNING)  # the quantiser's advice on pre-processing is for calibrated models
        try:
            quantize_dynamic(
                str(exported), str(quantised), per_channel=True, weight_type=QuantType.QInt8,
                nodes_to_exclude=layers_kept_in_fp32(onnx.load(str(exported))),
                extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
            )
        finally:
            logging.disable(before)
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1  # passes run side by side instead (`Int8Encoder.encode`)
        options.inter_op_num_threads = 1
        options.log_severity_level = 3  # errors only: its warnings about unused initializers are noise here
        return ort.InferenceSession(quantised.read_bytes(), options, providers=["CPUExecutionProvider"])
