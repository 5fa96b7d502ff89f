"""Context parallelism on the tiny MindFormers 2.0.0 ``GPTModel`` (``test_gptmodel``) on
MindSpore CPU, through MindFormers' own ``parallelize_gptmodel``: ``context_parallel=2``
on 2 ranks and ``context_parallel=2 x data_parallel=2`` (FSDP over ``dp_shard * cp``) on 4,
loss and gradients against one rank; also its "ulysses" (the same meshes) and "hybrid"
(cp 4, Ulysses 2) methods (``test_gptmodel_cp_ulysses``), each causal and with packed documents.

What runs is MindFormers' default ("colossal") path, as its trainer sets it up:

- the config as ``trainer/utils._build_model`` makes it: ``attach_context_parallel_runtime_hints``
  (``context_parallel_size``, ``input_layout="BSH"``), and what ``TransformerConfig`` and
  ``apply_context_parallel_model_io`` require for CP: ``use_flash_attention=True`` and
  ``use_attn_mask_compression=True`` (or the EOD flag below), which in turn needs ``seq_length >= 2048``
  (``CausalMaskGenerate`` builds its 2048 x 2048 compressed mask). ``seq_length`` is only
  that bound here: the model sees 8 tokens (``max_sequence_length=8``);
- the inputs as its trainer passes them (``model(**batch)``, keywords: the root hook
  ``ContextParallelModelIOStyle`` maps positional arguments by its own
  ``_INPUT_NAMES``, whose first entry is ``decoder_input``, not ``GPTModel``'s
  ``input_ids``), with the ``position_ids`` that hook requires; learned absolute position
  embeddings (``position_embedding_type="learned_absolute"``) make the sliced
  ``position_ids`` count (no RoPE on MindSpore 2.10 CPU, see ``test_gptmodel``);
- ``parallelize_gptmodel``: ``apply_context_parallel_attention`` puts
  ``ContextParallelAttentionStyle("colossal", 2, 1, "BSH")`` on every layer's
  ``core_attention`` (its pre-hook turns SBND q/k/v into BSH ``(batch, seq/cp, heads*dim)``,
  then this package's ``ContextParallel(seq_dim=1, head_dim=2, ulysses_degree=1)``, whose
  frame makes ``scaled_dot_product_attention`` all-gather K/V with the causal offset of
  this rank's query chunk; its post-hook turns BSH back to SBH), ``fully_shard`` over the
  ``fsdp`` mesh (``dp_shard * cp`` ranks) and ``apply_context_parallel_model_io`` (the
  root pre-hook slicing ``input_ids`` / ``labels`` / ``position_ids`` to this rank's
  contiguous chunk).

Packed documents (``eod``): ``use_eod_attn_mask_compression`` (``create_compressed_eod_mask``
in the dataset config) and ``actual_seq_len`` batched as MindFormers' dataset does (each
row's document ends offset by the rows before it). Under colossal CP MindFormers keeps
``input_layout="BSH"`` (the hint overrides the config's ``"TND"``), its root hook flattens
the rows into one sequence before cutting it and passes ``actual_seq_len`` whole, and the
core attention gets it as ``actual_seq_qlen``: ``cu_seqlens`` of the whole flattened
sequence, as ``scaled_dot_product_attention`` takes it. With ``data_parallel=2`` a document
crosses the two CP ranks' boundary.

Test-local classes, through the layer spec (MindFormers and MindSpore are not patched):

- ``CPUFlashAttention`` as ``core_attention`` (on one rank, and in the tests other than
  ``test_gptmodel_cp_flash_attention``, which runs MindFormers' own ``FlashAttention``: under
  colossal / hybrid CP its ``FlashAttentionScore`` calls are on the hooks' DTensors, which
  this package computes): MindFormers' ``FlashAttention`` runs ``FlashAttentionScore``
  (Ascend-only kernel) on plain tensors; this one has its interface and layout rules
  (``input_layout``, ``_mf_runtime_input_already_in_fa_layout``), its compressed masks
  (``sparse_mode`` 2: causal; 3: causal within ``actual_seq_qlen`` documents) and computes
  through ``hyper_parallel.scaled_dot_product_attention``;
- ``CPUSelfAttention`` as the ``self_attention`` module: MindFormers' ``SelfAttention`` with
  q, k, v made fresh tensors after its ``mint.split`` (MindSpore 2.10 CPU differentiates a
  permute of a split view wrongly, ``test_gptmodel``; both ``Attention.sbh2tnd`` for TND and
  the CP pre-hook permute them: without this the 1-rank EOD gradients below the last
  attention are wrong, errors of the order of the gradients), and without the float16 cast
  of float32 q/k/v that ``use_flash_attention`` makes for the Ascend kernel
  (``transformers/attention.py``), so the float32 model stays float32 and gradients compare
  at float32 rounding (measured: within 1e-6 of each parameter's largest gradient entry;
  the loss within 1e-7 relative).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.mindformers.test_gptmodel import (BATCH, HEADS, HIDDEN, SEQ, batch, build_gpt, gpt_config, parallelize,
                                             pytestmark, rank_result)  # noqa: F401


#: ``seq_length`` that ``use_attn_mask_compression`` needs (``CausalMaskGenerate``).
COMPRESSED_MASK_SEQ = 2048


def _attention_classes():
    """``CPUFlashAttention`` and ``CPUSelfAttention`` (defined here so MindSpore is imported in the ranks only)."""
    import mindspore as ms
    from mindformers.pynative.transformers.attention import SelfAttention
    from mindspore import mint, nn, ops

    import hyper_parallel

    class CPUFlashAttention(nn.Cell):
        """MindFormers' ``FlashAttention`` interface and layouts over
        ``hyper_parallel.scaled_dot_product_attention``, causal.

        Layouts: without context parallelism SBND q/k/v in, SBH out (``input_layout``
        ``"BNSD"``), or TND in and out (``"TND"``, EOD compression); under MindFormers'
        CP hooks (``_mf_runtime_input_already_in_fa_layout``) colossal BSH
        ``(batch, seq / cp, heads * head_dim)`` in and out, Ulysses / hybrid BNSD, or TND
        with EOD compression, in and out. Masks: ``attention_mask`` is
        MindFormers' compressed causal mask, ``sparse_mode=2`` (causal) or ``3`` (causal
        within the packed documents whose cumulative ends ``actual_seq_qlen`` gives, over
        the whole flattened sequence: ``cu_seqlens``); the positions of this rank's chunk
        come from the CP frame."""

        def __init__(self, config, layer_number, softmax_scale=None):
            super().__init__()
            self.head_num = config.num_attention_heads
            self.input_layout = config.input_layout
            self.sparse_mode = config.sparse_mode
            head_dim = config.kv_channels
            self.scale = 1.0 / float(np.sqrt(head_dim)) if softmax_scale is None else softmax_scale

        def construct(self, query, key, value, attention_mask, alibi_mask=None, prefix=None, padding_mask=None,
                      actual_seq_qlen=None, actual_seq_kvlen=None):
            if self.sparse_mode not in (2, 3) or alibi_mask is not None or prefix is not None \
                    or padding_mask is not None or (actual_seq_qlen is None) != (self.sparse_mode == 2):
                raise NotImplementedError("CPUFlashAttention: MindFormers' compressed causal masks only "
                                          "(sparse_mode 2, or 3 with actual_seq_qlen)")
            cu_seqlens = None
            if actual_seq_qlen is not None:
                ends = actual_seq_qlen.asnumpy().reshape(-1)
                if not np.array_equal(ends, actual_seq_kvlen.asnumpy().reshape(-1)):
                    raise NotImplementedError("CPUFlashAttention: self-attention (actual_seq_kvlen == qlen)")
                cu_seqlens = np.concatenate([[0], ends]).astype(np.int64)
            # what MindFormers' hooks delivered (checked by the test): this rank's piece, and
            # whether it came as a DTensor (the K/V exchange modes: [Note: q/k/v as DTensors])
            is_dtensor = isinstance(query, hyper_parallel.DTensor)
            self.seen = (tuple((query.to_local() if is_dtensor else query).shape), is_dtensor)

            def attend(q, k, v):  # BSHD float32 views
                return hyper_parallel.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                                                   cu_seqlens=cu_seqlens)

            if self.input_layout == "TND":  # EOD without CP, or under Ulysses / hybrid CP: TND in and out
                out = attend(*(mint.unsqueeze(t.astype(ms.float32), 0) for t in (query, key, value)))
                return out[0]
            if getattr(self, "_mf_runtime_input_already_in_fa_layout", False) and self.input_layout == "BNSD":
                # Ulysses / hybrid CP: whole sequences (hybrid: 1 / cp_kv of them) of heads / ulysses heads
                return hyper_parallel.scaled_dot_product_attention(
                    *(t.astype(ms.float32) for t in (query, key, value)), is_causal=True, scale=self.scale,
                    cu_seqlens=cu_seqlens, layout="BNSD")
            if getattr(self, "_mf_runtime_input_already_in_fa_layout", False):
                if self.input_layout != "BSH":
                    raise NotImplementedError(f"CPUFlashAttention: input_layout {self.input_layout!r} under CP")
                batch, seq = query.shape[:2]
                out = attend(*(mint.reshape(t.astype(ms.float32), (batch, seq, self.head_num, -1))
                               for t in (query, key, value)))
                return mint.reshape(out, (batch, seq, -1))
            seq, batch = query.shape[:2]  # SBND
            out = attend(*(mint.permute(t.astype(ms.float32), (1, 0, 2, 3)) for t in (query, key, value)))
            return mint.reshape(mint.permute(out, (1, 0, 2, 3)), (seq, batch, -1))

    class CPUSelfAttention(SelfAttention):
        """MindFormers' ``SelfAttention``, two changes for MindSpore CPU:

        - q, k, v are made fresh tensors (``* 1.0``) right after its ``mint.split`` of the
          qkv projection: MindSpore 2.10 CPU differentiates a permute of a ``mint.split``
          view wrongly (``test_gptmodel``), and both ``Attention.sbh2tnd`` (EOD compression
          without CP, ``input_layout="TND"``) and MindFormers' colossal CP pre-hook
          (``_prepare_attention_qkv``) permute them;
        - its cast of float32 q/k/v to float16 for the Ascend kernel (``use_flash_attention``)
          is skipped: the float32 model stays float32 end to end, as the CPU core attention
          computes in float32 anyway, so gradients compare at float32 rounding."""

        def __init__(self, config, submodules, layer_number):
            super().__init__(config, submodules, layer_number)
            self.cast = self._cast

        @staticmethod
        def _cast(x, dtype):
            if dtype == ms.float16 and x.dtype == ms.float32:
                return x
            return ops.cast(x, dtype)

        def get_query_key_value_tensors(self, hidden_states, key_value_states=None):
            return tuple(t * 1.0 for t in super().get_query_key_value_tensors(hidden_states, key_value_states))

    return CPUFlashAttention, CPUSelfAttention


def cp_config(parallelism=None, eod: bool = False):
    """The config MindFormers' trainer builds for CP (``parallelism`` given) or the same
    model without it (``None``); ``eod``: packed documents (``use_eod_attn_mask_compression``,
    what ``create_compressed_eod_mask`` in the dataset config turns on) instead of
    ``use_attn_mask_compression``."""
    from mindformers.pynative.distributed.context_parallel import attach_context_parallel_runtime_hints

    mask = {"use_eod_attn_mask_compression": True} if eod else {"use_attn_mask_compression": True}
    config = gpt_config(use_flash_attention=True, seq_length=COMPRESSED_MASK_SEQ,
                        max_position_embeddings=COMPRESSED_MASK_SEQ, position_embedding_type="learned_absolute", **mask)
    return attach_context_parallel_runtime_hints(config, parallelism)


#: The packed documents of each row (``eod``): cumulative ends within the row. With
#: data_parallel=2 x context_parallel=2 the second document of each row crosses the
#: ranks' boundary (token 4); with context_parallel=2 alone the two ranks hold a row each.
ROW_DOCUMENT_ENDS = ((3, SEQ), (5, SEQ))


def cp_batch(rows: slice = slice(None), eod: bool = False) -> dict[str, np.ndarray]:
    """``input_ids`` / ``labels`` of ``test_gptmodel.batch()`` (no pad token) for ``rows``
    and their ``position_ids``: 0..SEQ-1, or with ``eod`` counted from each document's start,
    and ``actual_seq_len`` as MindFormers' dataset batches it (``asl_batch_wrapper``: each
    row's document ends offset by the rows before it)."""
    ids, labels = batch()
    picked = range(BATCH)[rows]
    out = {"input_ids": ids[rows], "labels": labels[rows],
           "position_ids": np.tile(np.arange(SEQ, dtype=np.int32), (len(picked), 1))}
    if eod:
        ends = np.array([ROW_DOCUMENT_ENDS[r] for r in picked], np.int32)
        for row, row_ends in enumerate(ends):
            for start, end in zip((0, *row_ends[:-1]), row_ends):
                out["position_ids"][row, start:end] = np.arange(end - start)
        out["actual_seq_len"] = ends + SEQ * np.arange(len(picked), dtype=np.int32)[:, None]
    return out


def _loss_and_grads(model, inputs: dict):
    """``value_and_grad`` of the model's loss called as MindFormers' trainer calls it,
    ``model(**batch)``, over every parameter."""
    import mindspore as ms

    names = sorted(inputs)
    params = [q for _, q in model.parameters_and_names()]

    def loss_fn(*values):
        return model(**dict(zip(names, values)))[0]

    return ms.value_and_grad(loss_fn, grad_position=None, weights=params)(*(ms.Tensor(inputs[n]) for n in names))


def check_one_rank(eod: bool = False) -> dict:
    """The whole batch on one rank, no CP: loss and gradients."""
    model = build_gpt(cp_config(eod=eod), *_attention_classes())
    loss, grads = _loss_and_grads(model, cp_batch(eod=eod))
    return {"loss": float(loss.asnumpy().reshape(-1)[0]),
            "grads": {name: g.asnumpy() for (name, _), g in zip(model.parameters_and_names(), grads)}}


def check_cp(cp: int, eod: bool = False, method: str = "colossal", ulysses: int | None = None,
             flash_attention: bool = False) -> dict:
    """MindFormers' ``ParallelDims.from_config`` + ``parallelize_gptmodel`` with
    ``context_parallel=cp`` and ``data_parallel = world / cp`` (FSDP), the model built under
    meta as the trainer does, this rank's batch rows (dataloading mesh ``(pp, batch, cp,
    tp)``: rank ``= batch_index * cp + cp_index``); the root hook cuts the sequence.
    ``method`` / ``ulysses``: ``context_parallel_method`` / ``ulysses_degree_in_cp``;
    ``flash_attention``: MindFormers' own ``FlashAttention`` as the core attention (its
    ``FlashAttentionScore`` calls computed by this package's context parallelism), not
    ``CPUFlashAttention``."""
    from hyper_parallel.platform import get_platform

    p = get_platform()
    world, me = p.world_size(), p.rank()
    attention = _attention_classes()
    if flash_attention:
        from mindformers.pynative.layers.flash_attention import FlashAttention

        attention = (FlashAttention, attention[1])
    model = parallelize(lambda parallelism: build_gpt(cp_config(parallelism, eod), *attention),
                        context_parallel=cp, context_parallel_method=method, ulysses_degree_in_cp=ulysses,
                        data_parallel=world // cp)
    if method == "colossal":
        assert model.config.input_layout == "BSH" and model.config.context_parallel_size == cp
    dp_index, dp = me // cp, world // cp
    rows = slice(dp_index * BATCH // dp, (dp_index + 1) * BATCH // dp)
    loss, grads = _loss_and_grads(model, cp_batch(rows, eod))
    # colossal, BSH: this rank's rows and its 1/cp of the sequence (with EOD the root hook
    # flattens the rows into one sequence first); Ulysses / hybrid, BNSD: heads / ud of
    # cp_kv times as much sequence
    if method == "colossal":
        want = (1, BATCH // dp * SEQ // cp, HIDDEN) if eod else (BATCH // dp, SEQ // cp, HIDDEN)
    elif eod:  # TND, the rows flattened into one sequence
        ud = ulysses or cp
        want = (BATCH // dp * SEQ // cp * ud, HEADS // ud, HIDDEN // HEADS)
    else:
        ud = ulysses or cp
        want = (BATCH // dp, HEADS // ud, SEQ // cp * ud, HIDDEN // HEADS)
    for layer in model.decoder.layers if not flash_attention else ():
        seen = layer.self_attention.core_attention.seen
        assert seen == (want, method != "ulysses"), (seen, want)
    return rank_result(model.parameters_and_names(), loss, grads, main_grad=True)


def _compare(one: dict, ranks: list[dict], summed_over: int | None = None) -> None:
    """``summed_over``: the ranks whose gradients fully_shard sums (default: all; tensor
    parallel ranks hold the same tokens and are not summed)."""
    world = summed_over or len(ranks)
    # every rank holds BATCH * SEQ / world tokens, none masked (no pad token, none ignored):
    # the mean of the ranks' mean losses is the whole batch's
    np.testing.assert_allclose(np.mean([r["loss"] for r in ranks]), one["loss"], rtol=1e-5)
    for name, want in one["grads"].items():
        got = np.zeros_like(want)
        seen = np.zeros(want.shape, bool)
        for r in ranks:
            entry = r["params"][name]
            index = tuple(slice(b, e) for b, e in entry["area"])
            # reduce op "sum" over the fsdp mesh (dp_shard * cp): each rank's mean loss, summed
            got[index] = entry["grad"] / world
            seen[index] = True
        assert seen.all(), name
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max(), err_msg=name)


@pytest.mark.parametrize("eod", [False, True], ids=["causal", "eod"])
def test_gptmodel_cp_two_ranks(run_on_ranks, eod) -> None:
    one = run_on_ranks(check_one_rank, eod, world_size=1, timeout_s=300)[0]
    two = run_on_ranks(check_cp, 2, eod, world_size=2, timeout_s=300)
    assert all(r["params"]["decoder.layers.0.self_attention.linear_qkv.weight"]["placements"] == ["Shard(dim=0)"]
               for r in two)
    _compare(one, two)


@pytest.mark.parametrize("eod", [False, True], ids=["causal", "eod"])
def test_gptmodel_cp_dp_four_ranks(run_on_ranks, eod) -> None:
    one = run_on_ranks(check_one_rank, eod, world_size=1, timeout_s=300)[0]
    four = run_on_ranks(check_cp, 2, eod, world_size=4, timeout_s=600)
    _compare(one, four)


@pytest.mark.parametrize("eod", [False, True], ids=["causal", "eod"])
@pytest.mark.parametrize("cp,ulysses,world", [(2, None, 2), (2, None, 4), (4, 2, 4)],
                         ids=["ulysses-cp2", "ulysses-cp2-dp2", "hybrid-cp4-u2"])
def test_gptmodel_cp_ulysses(run_on_ranks, cp, ulysses, world, eod) -> None:
    """MindFormers' ``context_parallel_method`` "ulysses" / "hybrid": its pre-hook hands BNSD
    q/k/v (with EOD compression, TND ``[tokens, heads, head_dim]`` as they are) to this
    package's ``ContextParallel(seq_dim=2, head_dim=1)`` (TND: ``seq_dim=0, head_dim=1``),
    whose all-to-all gives the core attention whole sequences (hybrid: half of them, K/V
    all-gathered over the other axis) of a share of the heads."""
    one = run_on_ranks(check_one_rank, eod, world_size=1, timeout_s=300)[0]
    ranks = run_on_ranks(check_cp, cp, eod, "ulysses" if ulysses is None else "hybrid", ulysses,
                         world_size=world, timeout_s=600)
    _compare(one, ranks)


@pytest.mark.parametrize("method,cp,ulysses,world,eod", [
    ("colossal", 2, None, 2, False), ("colossal", 2, None, 4, False),
    ("hybrid", 4, 2, 4, False), ("hybrid", 4, 2, 4, True)],
    ids=["colossal-cp2", "colossal-cp2-dp2", "hybrid-cp4-u2", "hybrid-cp4-u2-eod"])
def test_gptmodel_cp_flash_attention(run_on_ranks, method, cp, ulysses, world, eod) -> None:
    """MindFormers' own ``FlashAttention`` cell as the core attention: its
    ``FlashAttentionScore`` calls (BSH causal under colossal, BNSD / TND with packed documents
    under hybrid) on the sequence-sharded DTensors the hooks hand in are computed by this
    package's context parallelism (the primitive has no CPU kernel: nothing else could run
    it here), against one rank of ``CPUFlashAttention`` (the same attention through
    ``scaled_dot_product_attention``)."""
    one = run_on_ranks(check_one_rank, eod, world_size=1, timeout_s=300)[0]
    ranks = run_on_ranks(check_cp, cp, eod, method, ulysses, True, world_size=world, timeout_s=600)
    _compare(one, ranks)


def check_colossal_eod_refused() -> str:
    """MindFormers' colossal CP with packed documents hands ``FlashAttention`` BSH q/k/v with
    ``actual_seq_qlen``, which ``FlashAttentionScore`` takes with ``TND`` only: refused. The
    forward runs outside ``value_and_grad``: an exception inside it leaves MindSpore 2.10's
    PyNative grad state behind in the worker (the next test's in-place copies then fail)."""
    import mindspore as ms
    from mindformers.pynative.layers.flash_attention import FlashAttention

    attention = (FlashAttention, _attention_classes()[1])
    model = parallelize(lambda parallelism: build_gpt(cp_config(parallelism, True), *attention),
                        context_parallel=2, context_parallel_method="colossal", data_parallel=1)
    try:
        model(**{n: ms.Tensor(a) for n, a in cp_batch(eod=True).items()})
    except ValueError as e:
        return str(e)
    raise AssertionError("colossal CP with packed documents through FlashAttentionScore was not refused")


def test_gptmodel_cp_flash_attention_refuses_bsh_documents(run_on_ranks) -> None:
    for message in run_on_ranks(check_colossal_eod_refused, world_size=2, timeout_s=300):
        assert "actual_seq_qlen" in message and "'TND'" in message, message


def check_track_max_logit_refused(method: str, ulysses: int | None) -> str:
    """``track_max_attention_logit`` (QK-clip's per-head maximum logit) reads the
    primitive's ``softmax_max``, which the attention under colossal / hybrid CP does not
    compute: refused by name on every rank, not a failure inside MindFormers' ``amax``.
    Outside ``value_and_grad``, as above."""
    import mindspore as ms
    from mindformers.pynative.layers.flash_attention import FlashAttention

    def build(parallelism):
        config = cp_config(parallelism)
        config.track_max_attention_logit = True
        return build_gpt(config, FlashAttention, _attention_classes()[1])

    model = parallelize(build, context_parallel=2, context_parallel_method=method, data_parallel=1,
                        **({} if ulysses is None else {"ulysses_degree_in_cp": ulysses}))
    try:
        model(**{n: ms.Tensor(a) for n, a in cp_batch().items()})
    except NotImplementedError as e:
        return str(e)
    raise AssertionError("track_max_attention_logit under context parallelism was not refused")


@pytest.mark.parametrize("method,ulysses", [("colossal", None)])
def test_gptmodel_cp_refuses_track_max_attention_logit(run_on_ranks, method, ulysses) -> None:
    for message in run_on_ranks(check_track_max_logit_refused, method, ulysses, world_size=2, timeout_s=300):
        assert "track_max_attention_logit=True reads softmax_max" in message, message


def check_mla_async(cp: int, ulysses: int) -> dict:
    """MindFormers' asynchronous context parallelism (``context_parallel_async``, methods
    "ulysses" / "hybrid") on the multi-latent-attention model of ``test_gptmodel_tp`` (the
    attention with the ``q_handoff`` / ``k_handoff`` / ``v_handoff`` cells it needs):
    ``parallelize_gptmodel`` hooks those identity cells as this package's
    ``AsyncContextParallel`` projections, which return q/k/v sequence-first (SBND), and the
    core attention: ``CPUFlashAttention`` under pure Ulysses (plain tensors: MindFormers'
    ``FlashAttention`` would run the primitive, which has no CPU kernel), MindFormers' own
    ``FlashAttention`` under hybrid (its ``FlashAttentionScore`` on the hooks' DTensors).
    Loss and gradients as ``check_cp``."""
    from mindformers.pynative.layers.flash_attention import FlashAttention

    from tests.mindformers.test_gptmodel_tp import build_mla_gpt

    core = _attention_classes()[0] if ulysses == cp else FlashAttention
    model = parallelize(lambda parallelism: build_mla_gpt(flash_attention=True, core_attention=core),
                        context_parallel=cp, context_parallel_method="ulysses" if ulysses == cp else "hybrid",
                        ulysses_degree_in_cp=ulysses, context_parallel_async=True, data_parallel=1)
    loss, grads = _loss_and_grads(model, cp_batch())
    return rank_result(model.parameters_and_names(), loss, grads)


@pytest.mark.parametrize("cp,ulysses,world", [(2, 2, 2), (4, 2, 4)], ids=["ulysses-cp2", "hybrid-cp4-u2"])
def test_mla_async_context_parallel(run_on_ranks, cp, ulysses, world) -> None:
    from tests.mindformers.test_gptmodel_tp import check_mla_one_rank

    one = run_on_ranks(check_mla_one_rank, world_size=1, timeout_s=300)[0]
    ranks = run_on_ranks(check_mla_async, cp, ulysses, world_size=world, timeout_s=600)
    _compare(one, ranks)


def check_mla_tp_cp() -> dict:
    """MindFormers' tensor parallelism (``apply_non_moe_tp`` on the multi-latent-attention
    model) with its Ulysses context parallelism: the core attention receives q/k/v as
    DTensors on the tp mesh with their heads sharded, runs context parallelism on its own
    heads ([Note: context parallelism over tensor-parallel heads]) and hands back a tp
    DTensor. ``CPUFlashAttention`` is the core attention (pure Ulysses hands plain tensors:
    MindFormers' ``FlashAttention`` would run the primitive, which has no CPU kernel)."""
    import mindspore as ms

    from hyper_parallel import DTensor
    from tests.mindformers.test_gptmodel_tp import build_mla_gpt

    model = parallelize(lambda parallelism: build_mla_gpt(flash_attention=True, core_attention=_attention_classes()[0]),
                        context_parallel=2, context_parallel_method="ulysses", ulysses_degree_in_cp=2,
                        tensor_parallel=2, data_parallel=1)
    inputs = cp_batch()
    names = sorted(inputs)
    params = [q for _, q in model.parameters_and_names()]

    def loss_fn(*values):
        loss = model(**dict(zip(names, values)))[0]
        return loss.to_local() if isinstance(loss, DTensor) else loss

    loss, grads = ms.value_and_grad(loss_fn, grad_position=None, weights=params)(*(ms.Tensor(inputs[n])
                                                                                  for n in names))
    return rank_result(model.parameters_and_names(), loss, grads)


def test_mla_tensor_and_context_parallel(run_on_ranks) -> None:
    """tp 2 x cp 2 (Ulysses) on 4 ranks against one rank: the tp ranks hold the same
    tokens and replicated parameters' whole gradients (a replicated loss seeded once, see
    docs/mindformers.md on the loss sense), the cp ranks each their mean loss over half the
    tokens (fully_shard sums over cp)."""
    from tests.mindformers.test_gptmodel_tp import check_mla_one_rank

    one = run_on_ranks(check_mla_one_rank, world_size=1, timeout_s=300)[0]
    _compare(one, run_on_ranks(check_mla_tp_cp, world_size=4, timeout_s=600), summed_over=2)  # cp = 2
