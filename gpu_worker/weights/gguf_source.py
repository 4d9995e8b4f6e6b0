"""GGUFSource: a llama.cpp GGUF file (or a split set) of qwen3moe / qwen3next as a WeightSource.

Parsed with the ``gguf`` package's GGUFReader (metadata, tensor infos, a read-only map of
each file); the config comes from the metadata, each canonical tensor from its llama.cpp
name (gpu_worker/weights/gguf_names.py), dequantized to float on read
(gpu_worker/weights/gguf_quants.py). Everything is validated when the source is made,
before any tensor data is read: architecture, metadata keys, names, shapes, types.

GGUF lists a tensor's dimensions fastest first (``ne``); the reader's numpy shapes are
those reversed, so a stored ``[E, I, H]`` numpy array is what llama.cpp calls ne
``[H, I, E]``: numpy order is used throughout here.

Q8_0 and Q4_0 expert stacks can also be read as their stored blocks of 32
(:meth:`read_blocks`), so the CPU experts hold exactly the file's numbers where their format
allows (gpu_worker/weights/stream.py, cpu_experts/formats.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from cpu_experts.formats import Blocks
from gpu_worker.model_config import ModelConfig, ModelConfigError
from gpu_worker.weights.gguf_names import A_LOG, ARCHS, NORM_SHIFT, QKVZ, Stored, config_dict
from gpu_worker.weights.gguf_names import gguf_name as stored_name
from gpu_worker.weights.gguf_quants import (
    SUPPORTED,
    T,
    dequantize,
    q4_0_split,
    q8_0_for_cpu,
    q8_0_split,
    type_name,
)
from gpu_worker.weights.source import CheckpointError, Shape, check_read
from gpu_worker.weights_spec import expected_tensors

_FUSED = re.compile(r"^(blk\.\d+)\.ffn_(gate|up)_exps\.weight$")
END_TOKENS = ("<|im_end|>", "<|endoftext|>")
SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclasses.dataclass(frozen=True, slots=True)
class _Tensor:
    """One tensor as stored: its file's map, byte range, type and numpy shape."""

    data: np.memmap
    offset: int
    nbytes: int
    qtype: T
    shape: Shape

    def rows(self) -> np.ndarray:
        """The stored bytes as ``[*shape[:-1], row_bytes]`` (a view of the map)."""
        raw = self.data[self.offset:self.offset + self.nbytes]
        return raw.reshape(*self.shape[:-1], -1)


def split_files(path: Path) -> list[Path]:
    """The files of a GGUF: ``path`` alone, or every part ``-0000k-of-0000N.gguf`` of a
    split set given by its first part."""
    m = SPLIT.match(path.name)
    if m is None:
        return [path]
    count = int(m.group("count"))
    if int(m.group("no")) != 1:
        raise CheckpointError(f"{path}: give the first file of a split GGUF "
                              f"({m.group('stem')}-00001-of-{count:05d}.gguf)")
    files = [path.with_name(f"{m.group('stem')}-{k:05d}-of-{count:05d}.gguf")
             for k in range(1, count + 1)]
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{f}: missing part of a split GGUF ({count} files)")
    return files


class GGUFSource:
    """The canonical tensors of GGUF file ``path`` (the first file of a split set), read
    on demand. ``include_mtp=False`` skips the MTP weights."""

    def __init__(self, path: str | Path, *, include_mtp: bool = True) -> None:
        self.path: Path | None = Path(path)
        files = split_files(self.path)
        readers = []
        for f in files:
            try:
                readers.append(GGUFReader(f, "r"))
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{f}: not a readable GGUF file: {exc}") from None
        self._fields = readers[0].fields
        self.tensors: dict[str, _Tensor] = {}
        for reader in readers:
            for t in reader.tensors:
                shape = tuple(int(d) for d in reversed(t.shape.tolist()))
                self.tensors[t.name] = _Tensor(reader.data, int(t.data_offset),
                                               int(t.n_bytes), T(t.tensor_type), shape)
        self.arch = self.meta("general.architecture")
        if self.arch not in ARCHS:
            raise CheckpointError(f"{self.path}: unknown architecture {self.arch!r} "
                                  f"(Tandem reads {', '.join(ARCHS)})")
        shapes = {n: t.shape for n, t in self.tensors.items()}
        try:
            self.config = ModelConfig.from_dict(config_dict(self.meta, self.arch, shapes))
        except KeyError as exc:
            raise CheckpointError(f"{self.path}: missing metadata key {exc.args[0]}") from None
        except (ModelConfigError, ValueError, TypeError) as exc:
            raise CheckpointError(f"{self.path}: metadata: {exc}") from None
        self._shapes = expected_tensors(self.config, include_mtp=include_mtp)
        self._plan = {name: self._locate(name, shape) for name, shape in self._shapes.items()
                      if not (name == "lm_head.weight" and self.config.tie_word_embeddings)}

    def meta(self, key: str) -> Any:
        """Metadata value ``key`` as a Python value (None when absent)."""
        field = self._fields.get(key)
        if field is None:
            return None
        value = field.contents()
        if field.types and field.types[0] == GGUFValueType.ARRAY:
            return list(value)
        if field.types[0] == GGUFValueType.FLOAT32:  # 1e-06 stored as float32 -> 1e-06
            return float(str(np.float32(value)))
        return value.item() if isinstance(value, np.generic) else value

    # -- WeightSource ---------------------------------------------------------------------
    def shapes(self) -> dict[str, Shape]:
        return dict(self._shapes)

    def nbytes(self, name: str) -> int:
        entry = self._entry(name)
        total = sum(self.tensors[n].nbytes for n in entry.names)
        return total // 2 if entry.part is not None else total

    def read(self, name: str, dtype: np.dtype, *, experts: Sequence[int] | None = None
             ) -> np.ndarray:
        entry = self._entry(name)
        dtype = check_read(name, dtype, experts)
        try:
            parts = [dequantize(self._rows(n, entry.part, experts), self.tensors[n].qtype)
                     for n in entry.names]
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{self.path}: reading tensor {entry.names[0]}: {exc}"
                                  ) from None
        shape = self._shapes[name]
        if experts is not None:
            shape = (len(experts), *shape[1:])
        if entry.transform == QKVZ:
            out = self._qkvz(*parts)
        elif entry.transform == A_LOG:  # stored -exp(A_log)
            out = np.log(-parts[0].astype(np.float64))
        elif entry.transform == NORM_SHIFT:  # stored w + 1
            out = parts[0] - np.float32(1)
        else:
            out = parts[0]
        return np.ascontiguousarray(out.reshape(shape), dtype=dtype)

    def read_blocks(self, name: str, experts: Sequence[int] | None = None) -> Blocks | None:
        """A stacked expert tensor stored as Q8_0 or Q4_0, as its blocks of 32
        (cpu_experts.formats.Blocks ``[n, rows, cols]``: the file's integers and fp16
        scales, no rounding; a Q8_0 block holding -128 re-quantized, gguf_quants.py); None
        when it is stored in another type."""
        entry = self._entry(name)
        qtype = self.tensors[entry.names[0]].qtype
        if len(entry.names) != 1 or qtype not in (T.Q8_0, T.Q4_0):
            return None
        raw = self._rows(entry.names[0], entry.part, experts)
        if qtype == T.Q4_0:
            return Blocks("q4_0", *q4_0_split(raw))
        return Blocks("q8_0", *q8_0_for_cpu(*q8_0_split(raw)))

    def stored_type(self, name: str) -> str:
        """The GGUF type name canonical tensor ``name`` is stored in (e.g. ``Q4_K``)."""
        return type_name(self.tensors[self._entry(name).names[0]].qtype)

    def generation_config(self) -> dict[str, Any]:
        """Sampling defaults (``general.sampling.*``) and ``eos_token_ids``: the
        tokenizer's eos / eot / eom ids plus Qwen's end tokens where the vocabulary has
        them (as llama.cpp ends generation on each)."""
        ids = [self.meta(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        tokens = self.meta("tokenizer.ggml.tokens") or []
        ids += [i for i, t in enumerate(tokens) if t in END_TOKENS]
        out: dict[str, Any] = {"eos_token_ids": list(dict.fromkeys(
            int(i) for i in ids if i is not None))}
        for key, name in (("temp", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                          ("min_p", "min_p")):
            value = self.meta(f"general.sampling.{key}")
            if value is not None:
                out[name] = value
        return out

    # -- internals ------------------------------------------------------------------------
    def _entry(self, name: str) -> Stored:
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        if name not in self._plan:
            raise KeyError(f"{self.path}: no canonical tensor {name}")
        return self._plan[name]

    def _rows(self, gguf: str, part: int | None, experts: Sequence[int] | None
              ) -> np.ndarray:
        """Stored bytes ``[..., row_bytes]`` of tensor ``gguf``: experts ``experts`` of a
        stack, the half ``part`` of axis 1 (fused gate/up), copied out of the map."""
        rows = self.tensors[gguf].rows()
        if experts is not None:
            rows = rows[np.asarray(experts, dtype=np.int64)]
        if part is not None:
            half = rows.shape[1] // 2
            rows = rows[:, part * half:(part + 1) * half]
        return np.array(rows)

    def _qkvz(self, qkv: np.ndarray, z: np.ndarray) -> np.ndarray:
        """``attn_qkv [all q | all k | all v] x H`` + ``attn_gate [all z] x H`` -> HF's
        in_proj_qkvz rows, per key head h: q_h, k_h, v_h, z_h."""
        cfg = self.config
        nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        vr = cfg.linear_num_value_heads // nk * cfg.linear_value_head_dim  # v rows per head
        H = qkv.shape[-1]
        q, k, v = np.split(qkv, [nk * dk, 2 * nk * dk])
        heads = [q.reshape(nk, dk, H), k.reshape(nk, dk, H), v.reshape(nk, vr, H),
                 z.reshape(nk, vr, H)]
        return np.concatenate(heads, axis=1).reshape(-1, H)

    def _locate(self, name: str, shape: Shape) -> Stored:
        """Where canonical ``name`` lies, checked: present, a supported type, the shape."""
        try:
            entry = stored_name(name, self.arch, self.config.num_hidden_layers)
        except KeyError:
            raise CheckpointError(f"{self.path}: no GGUF name for tensor {name}") from None
        fused = _FUSED.match(entry.names[0])
        if fused and entry.names[0] not in self.tensors:  # ffn_gate_up_exps [E, 2I, H]
            both = f"{fused.group(1)}.ffn_gate_up_exps.weight"
            if both in self.tensors:
                entry = Stored((both,), None, 0 if fused.group(2) == "gate" else 1)
        for n in entry.names:
            if n not in self.tensors:
                raise CheckpointError(f"{self.path}: missing tensor {n} (for {name}, "
                                      f"expected shape {shape})")
            if self.tensors[n].qtype not in SUPPORTED:
                raise CheckpointError(f"{self.path}: tensor {n} has unsupported type "
                                      f"{type_name(self.tensors[n].qtype)}")
        stored = [self.tensors[n].shape for n in entry.names]
        if entry.transform == QKVZ:
            got: Shape = (sum(s[0] for s in stored), *stored[0][1:])
        elif entry.part is not None:
            got = (stored[0][0], stored[0][1] // 2, *stored[0][2:])
        else:
            got = stored[0]
        if _squeezed(got) != _squeezed(shape):
            raise CheckpointError(f"{self.path}: tensor {entry.names[0]} has shape "
                                  f"{list(stored[0])} (numpy order), expected {list(shape)} "
                                  f"for {name}")
        return entry


def _squeezed(shape: Shape) -> Shape:
    return tuple(d for d in shape if d != 1)
