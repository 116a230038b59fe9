"""Tiny causal language models from ``transformers`` (the ``models`` extra), random-initialised from a
config, nothing downloaded: 2 layers, hidden 16, 2 heads, vocabulary 64, sequences of 8, every
dropout 0, eager attention (so the float64 replay runs the same kernels as the model-dtype run).

* ``gpt2``: GPT-2 style, input and output embedding TIED (``lm_head.weight`` is ``transformer.wte.weight``:
  one parameter), learned positions, LayerNorm, ``Conv1D`` projections stored ``[in, out]``. Note that
  DeepSpeed's name rule tags ``wte``/``wpe`` Muon (neither name holds "embed").
* ``llama``: Llama style, UNTIED ``model.embed_tokens`` / ``lm_head`` (both Adam by name), RMSNorm,
  grouped-query attention (2 query heads, 1 key/value head), rotary positions (an ``inv_freq`` buffer),
  gated MLP.

The batch: token ids drawn uniformly from the vocabulary, ``labels = input_ids`` (the model shifts).
"""
from __future__ import annotations

import functools

import torch

from harness.models import ModelSpec
from harness.models._data import generator, seeded_init

VOCAB, HIDDEN, LAYERS, HEADS, SEQ, BATCH = 64, 16, 2, 2, 8, 2


def _batch_fn(seed: int, tag: int):
    def batch(rank: int, step: int, micro: int) -> dict:
        g = generator(seed, tag, rank, step, micro)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}

    return batch


@functools.lru_cache(maxsize=8)
def _causal_mask(batch: int, seq: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask eager attention adds to its scores, as transformers builds it for a batch
    without padding: 0 where the key position is at or before the query's, the dtype's most negative
    finite value elsewhere, shaped ``(batch, 1, seq, seq)``. A 4-D ``attention_mask`` is used as given
    (``masking_utils._preprocess_mask_arguments``); ``cases/models/test_model_oracle.py`` checks the
    replay's losses and gradients are bit-equal with and without it."""
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()
    mask = torch.where(allowed, torch.tensor(0.0, dtype=dtype), torch.finfo(dtype).min)
    return mask.expand(batch, 1, seq, seq)


def _oracle_inputs(batch: dict, dtype: torch.dtype) -> dict:
    b, s = batch["input_ids"].shape
    return {"attention_mask": _causal_mask(int(b), int(s), dtype)}


def _eager(config):
    # transformers picks SDPA by default; eager attention is plain matmul + softmax in the model dtype
    config._attn_implementation = "eager"
    return config


def gpt2(seed: int) -> ModelSpec:
    from transformers import GPT2Config, GPT2LMHeadModel  # late: optional (the models extra)

    cfg = _eager(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
                            tie_word_embeddings=True, use_cache=False))
    seeded_init(seed, 0x6E2)
    module = GPT2LMHeadModel(cfg)
    return ModelSpec(module, _batch_fn(seed, 0x6E2B), oracle_inputs=_oracle_inputs)


def llama(seed: int) -> ModelSpec:
    from transformers import LlamaConfig, LlamaForCausalLM  # late: optional (the models extra)

    cfg = _eager(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                             num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=1,
                             max_position_embeddings=SEQ, attention_dropout=0.0, mlp_bias=False,
                             attention_bias=False, tie_word_embeddings=False, use_cache=False))
    seeded_init(seed, 0x11A)
    module = LlamaForCausalLM(cfg)
    return ModelSpec(module, _batch_fn(seed, 0x11AB), oracle_inputs=_oracle_inputs)
