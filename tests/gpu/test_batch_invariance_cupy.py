"""Batch invariance of the whole model on the GPU (issue 14, "What must hold"): tiny models of
both architectures in bf16 on CuPy with every new kernel on. A slot's row gives the same
logits bits decoded alone, one row at a time, as inside any layout of 1-4 slots (which slots,
in which order) x 1-5 rows per slot (a decode token plus up to 4 drafts, tracked as the
runner tracks them) run as one forward pass; prefill chunks sharing the step change nothing,
and a prompt's rows give the same bits however it is cut into chunks (one-row passes
included), so a prefix-cache hit or a re-prefill of a conversation's earlier turn leaves them.

``TANDEM_INVARIANCE_LAYOUTS``: ``all`` (default: every one of the 18,320 layouts per
architecture) or ``sample:N`` (about N of them, a fixed-seed sample spread evenly over the
slot counts; for slow runs such as the CPU emulator, scripts/cuda_emu). Run with ``-s`` to
see the layout counts and timings.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time

import numpy as np
import pytest

from gpu_worker.kernels import gdn_recurrent, moe_merged, paged_attention
from gpu_worker.kernels.bf16 import BF16
from gpu_worker.loader import load_checkpoint
from gpu_worker.model import attention, gdn, moe
from gpu_worker.model import ops as ops_module
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.model.model import Caches, Model
from scripts.tiny_model import make_tiny_model
from tests.gpu.invariance_layouts import (
    CHAIN,
    SLOTS,
    Failures,
    Probe,
    first_differing_record,
    layouts_from_env,
)

cupy = pytest.importorskip("cupy")

# per slot: prompt length; 14 and 31 put the chain across a KV block boundary (16, 32), 40
# spans three blocks; 31 and 40 are long prefills (> 16 rows: paged launches of their own)
PROMPTS = (5, 14, 31, 40)
BLOCK = 16
# the prefill slot of the mixed test: its first PREFILLED tokens are in the cache, the next
# chunk (3, 12 or 24 rows: the short paged launch or a long segment's) shares a step with
# decode rows
PREFILL_SLOT, PREFILLED, PREFILL_CHUNKS = SLOTS, 20, (3, 12, 24)
# few layers keep a forward at a few hundred launches (the exhaustive run is ~18,000 of them
# per architecture): qwen3_next one Gated DeltaNet and one full-attention layer, qwen3_moe one
# attention layer; every layer a sparse MoE (qwen3_next with its shared expert)
SIZES = {"qwen3_moe": {"layers": 1, "mtp": False},
         "qwen3_next": {"layers": 2, "full_attention_interval": 2, "mtp": False}}


@dataclasses.dataclass
class Setup:
    """The model, its caches after every slot's prefill, and each slot's reference chain."""

    arch: str
    model: Model
    caches: Caches
    start: dict[int, int]  # slot -> tokens in its cache (the prompt, PREFILLED for slot 4)
    base: dict[int, tuple | None]  # slot -> GDN states snapshot after its prefill
    prompt: dict[int, np.ndarray]
    chain: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # [CHAIN] tokens
    ref: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # [CHAIN, V] logits

    def restore(self, slots) -> None:
        """The slots' caches back to their state after the prefill: GDN states restored, KV
        blocks past the prompt dropped (positions after it are rewritten before read)."""
        for s in slots:
            self.caches.kv.truncate(s, self.start[s])
            if self.caches.states is not None:
                self.caches.states.restore(s, self.base[s])

    def forward(self, parts, tracked=()):
        """One pass over ``parts`` (slot, start, tokens) from the post-prefill caches; the
        ``tracked`` slots' rows keep per-row GDN states, as the runner does for drafted
        slots. -> (host logits of every row [R, V], the pass's ForwardOut)."""
        self.restore(s for s, _, _ in parts)
        batch = RaggedBatch.build(parts)
        states = self.caches.states
        verifying = (contextlib.nullcontext() if states is None
                     else states.verifying(tracked))
        with verifying:
            out = self.model.forward(batch, self.caches, np.arange(batch.num_rows))
        return cupy.asnumpy(out.logits), out

    def decode_row(self, slot: int, j: int) -> np.ndarray:
        """Row j of the slot's chain alone, on top of rows 0..j-1 (committed): logits [V]."""
        batch = RaggedBatch.build([(slot, self.start[slot] + j, self.chain[slot][j:j + 1])])
        return cupy.asnumpy(self.model.forward(batch, self.caches).logits)[0]

    def layout_parts(self, layout) -> list[tuple[int, int, np.ndarray]]:
        return [(s, self.start[s], self.chain[s][:n]) for s, n in layout]


@pytest.fixture(scope="module", params=list(SIZES))
def setup(request, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_GPU_KERNELS", "all")  # gpu_worker/kernels/enabled.py: every kernel
        arch = request.param
        path = make_tiny_model(tmp_path_factory.mktemp(arch), arch, seed=14, tokenizer=False,
                               **SIZES[arch])
        ckpt = load_checkpoint(path, dtype=np.float32)
        model = Model(ckpt.config, ckpt.tensors, xp=cupy, dtype=BF16)
        caches = model.new_caches(SLOTS + 1, 64, block_size=BLOCK)
        rng = np.random.default_rng(14)
        V = ckpt.config.vocab_size
        lengths = {**dict(enumerate(PROMPTS)), PREFILL_SLOT: PREFILLED + max(PREFILL_CHUNKS)}
        prompt = {s: rng.integers(0, V, size=n) for s, n in lengths.items()}
        st = Setup(arch, model, caches, {}, {}, prompt)
        t0 = time.perf_counter()
        for s, p in prompt.items():  # each slot's prefill alone
            n = PREFILLED if s == PREFILL_SLOT else len(p)
            out = model.forward(RaggedBatch.build([(s, 0, p[:n])]), caches)
            st.start[s] = n
            st.base[s] = None if caches.states is None else caches.states.snapshot(s)
            if s != PREFILL_SLOT:
                st.chain[s] = np.array([int(cupy.asnumpy(out.logits)[0].argmax())])
        for s in range(SLOTS):  # the reference: the chain decoded one row at a time, alone
            rows = []
            for j in range(CHAIN):
                rows.append(st.decode_row(s, j))
                if j + 1 < CHAIN:  # greedy: the next row is the token this one picks
                    st.chain[s] = np.append(st.chain[s], int(rows[-1].argmax()))
            st.ref[s] = np.stack(rows)
            st.restore([s])
        print(f"\n{arch}: prefill and reference chains in {time.perf_counter() - t0:.1f} s")
        yield st


def _localize(st: Setup, parts, tracked, slot: int) -> str:
    """Rerun the slot's chain row by row alone and the failing pass with every block's output
    recorded (invariance_layouts.Probe); name the first block whose rows differ."""
    row0 = 0
    for s, _, tokens in parts:
        if s == slot:
            rows = slice(row0, row0 + len(tokens))
            break
        row0 += len(tokens)
    st.restore([slot])
    alone = []
    for j in range(rows.stop - rows.start):
        with Probe() as probe:
            st.decode_row(slot, j)
        alone.append(probe.records)
    with Probe() as probe:
        st.forward(parts, tracked)
    st.restore(st.start)
    return (f"slot {slot} of {[(s, len(t)) for s, _, t in parts]}: "
            + first_differing_record(probe.records, rows, alone))


def _tracked(layout) -> list[int]:
    """The runner's rule: a slot with drafts (more than one row) is tracked."""
    return [s for s, n in layout if n > 1]


def test_the_step_takes_the_new_kernels(setup, monkeypatch):
    """Not a vacuous pass: a 2-slot verify step runs the row-tile products, one paged
    attention launch per attention layer, the GDN kernels per GDN layer and the merged
    expert kernels per MoE layer; no per-segment fallback."""
    st, cfg, calls = setup, setup.model.cfg, collections.Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for owner, name in ((ops_module, "linear_rows"), (ops_module, "linear_rows_split"),
                        (paged_attention, "paged_attention"),
                        (gdn_recurrent, "recurrence"), (moe_merged, "experts_merged"),
                        (attention, "_segment"), (gdn, "_token_loop")):
        monkeypatch.setattr(owner, name, counted(name, getattr(owner, name)))
    st.forward(st.layout_parts(((2, 3), (0, 1))), [2])
    st.restore(st.start)
    want = {"experts_merged": cfg.num_hidden_layers, "_segment": 0, "_token_loop": 0,
            "paged_attention": len(cfg.full_attention_layers),
            "recurrence": len(cfg.linear_attention_layers)}
    assert {name: calls[name] for name in want} == want, dict(calls)
    # an input and an output product per layer, the router's (alone or in a stack), lm_head
    products = calls["linear_rows"] + calls["linear_rows_split"]
    assert products >= 3 * cfg.num_hidden_layers + 1, dict(calls)


def test_every_layout_gives_each_row_the_bits_it_has_alone(setup):
    st = setup
    layouts, mode = layouts_from_env()
    fails = Failures(st.arch, layouts)
    t0 = time.perf_counter()
    for layout in layouts:
        got, _ = st.forward(st.layout_parts(layout), _tracked(layout))
        fails.add(layout, got, np.concatenate([st.ref[s][:n] for s, n in layout]))
    elapsed = time.perf_counter() - t0
    st.restore(st.start)
    print(f"{st.arch}: {len(layouts)} layouts ({mode}) in {elapsed:.1f} s, "
          f"{1e3 * elapsed / len(layouts):.1f} ms each; failing rows: {len(fails.rows)}")
    if fails:
        _, layout = fails.first
        slot = fails.rows[0][1]
        pytest.fail(fails.report() + "\n  " + _localize(st, st.layout_parts(layout),
                                                         _tracked(layout), slot))


@pytest.mark.parametrize("expert_rows", [moe.GROUPED_MAX_ROWS, 8])
def test_prefill_chunks_in_the_step_leave_the_decode_rows_bits(setup, monkeypatch,
                                                              expert_rows):
    """Slot 4's next prompt chunk (3 or 12 rows: the short paged launch; 24: a long
    segment's) first, in the middle or last among decode and verify segments: the decode
    rows' logits keep their bits, and so do the chunk's own rows; also with the expert
    kernels capped at 8 rows a call (a pass of more rows runs them over row blocks, as a
    512-row chunk beside decode rows does)."""
    monkeypatch.setattr(moe, "GROUPED_MAX_ROWS", expert_rows)
    st = setup
    decode = (((0, 5), (1, 1), (2, 3), (3, 2)), ((3, 5), (2, 5), (1, 5), (0, 5)),
              ((2, 1), (0, 1)))
    passes = [(c, layout, at) for c in PREFILL_CHUNKS for layout in decode
              for at in sorted({0, len(layout) // 2, len(layout)})]
    fails = Failures(st.arch, [layout for _, layout, _ in passes])
    alone, prefill_equal, first = {}, 0, None
    for c in PREFILL_CHUNKS:
        chunk = (PREFILL_SLOT, PREFILLED, st.prompt[PREFILL_SLOT][PREFILLED:PREFILLED + c])
        alone[c] = (chunk, st.forward([chunk])[0])
    for c, layout, at in passes:
        chunk, chunk_alone = alone[c]
        parts = st.layout_parts(layout)
        parts.insert(at, chunk)
        got, _ = st.forward(parts, _tracked(layout))
        row0 = sum(len(t) for _, _, t in parts[:at])
        prefill_equal += got[row0:row0 + c].tobytes() == chunk_alone.tobytes()
        label = f"{layout} with a {c}-row prefill chunk as segment {at}"
        if fails.add(layout, np.delete(got, np.s_[row0:row0 + c], axis=0),
                     np.concatenate([st.ref[s][:n] for s, n in layout]),
                     label) and first is None:
            first = (parts, layout)
    st.restore(st.start)
    print(f"{st.arch}: {len(passes)} passes with a prefill chunk, decode rows failing: "
          f"{len(fails.rows)}; the chunk's rows equal the chunk alone in "
          f"{prefill_equal}/{len(passes)}")
    if fails:
        parts, layout = first
        pytest.fail(fails.report() + "\n  " + _localize(st, parts, _tracked(layout),
                                                         fails.rows[0][1]))
    assert prefill_equal == len(passes), "a prefill chunk's rows changed with the step"


def _prompt_rows(st: Setup, cuts) -> np.ndarray:
    """Slot 4's prompt after its first PREFILLED tokens, in passes of ``cuts`` rows each,
    from the post-prefill cache -> every row's logits [sum(cuts), V]."""
    st.restore([PREFILL_SLOT])
    prompt, pos, out = st.prompt[PREFILL_SLOT], PREFILLED, []
    for n in cuts:
        batch = RaggedBatch.build([(PREFILL_SLOT, pos, prompt[pos:pos + n])])
        out.append(cupy.asnumpy(st.model.forward(batch, st.caches, np.arange(n)).logits))
        pos += n
    st.restore([PREFILL_SLOT])
    return np.concatenate(out)


@pytest.mark.parametrize("row_partitions", [attention.LONG_ROW_PARTITIONS, 1])
def test_a_prompt_gives_the_same_bits_however_it_is_chunked(setup, monkeypatch,
                                                            row_partitions):
    """The prompt's 24 rows as one-row passes (the bits of decode rows at those positions)
    are the reference; one 24-row chunk, 17 + 7, 3 + 21, 12 + 12 and 5 + 19 give each row
    the same logits bytes, with a long segment's rows in one launch or one launch per row
    (LONG_ROW_PARTITIONS = 1): what a prefix-cache hit or a re-prefilled turn relies on."""
    monkeypatch.setattr(attention, "LONG_ROW_PARTITIONS", row_partitions)
    n = max(PREFILL_CHUNKS)
    ref = _prompt_rows(setup, [1] * n)
    for cuts in ([n], [17, n - 17], [3, n - 3], [12, n - 12], [5, n - 5]):
        got = _prompt_rows(setup, cuts)
        bad = [i for i in range(n) if got[i].tobytes() != ref[i].tobytes()]
        assert not bad, f"{setup.arch}: chunks {cuts}: rows {bad} differ from one-row passes"
