"""Training passes on real tokens only: the rows of a micro-batch packed into one sequence.

A micro-batch in the layout of layout.py is [b, P + R] with left-padded prompts and
right-padded responses; run as it is, every matmul pays for b * (P + R) positions however
short most rows are. `pack` concatenates the real tokens of the rows into one row of T tokens
(positions restart at 0 for each sequence), and the attention function registered here
(`ATTENTION`, which fsdp.build_model sets on every worker model) attends within each sequence
only, from index tensors passed through the model's forward as the keyword `hflow_packing`.
The linear layers' work then follows the real tokens, and the LM head runs only where a
log-prob is read (`predict_at`).

    packed = pack(mb)
    out = model(**packed.model_inputs(), logits_to_keep=packed.predict_at)   # logits [1, K, V]
    logp = token_log_probs(out.logits[0], packed.targets)                    # [K]
    packed.unpack(logp)                                                      # [b, R], 0 elsewhere

Response token t of row i sits at packed index `start_i + p_i + t` (p_i real prompt tokens)
and is predicted from the output at the index before it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

ATTENTION = "hflow_varlen"


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     hflow_packing=None, **kwargs):
    """Causal attention inside each packed sequence. query [1, H, T, D], key/value
    [1, H_kv, T, D]; returns [1, T, H, D] as transformers' attention functions do.

    The sequences are gathered into one padded [b, H, L, D] batch for a single masked
    `scaled_dot_product_attention` (one autograd node, not one slice per sequence: slicing's
    backward writes a full-size gradient per slice), then scattered back to the T real tokens.
    Only attention pays for the padding, and it is a small part of a layer's FLOPs."""
    if hflow_packing is None:
        raise RuntimeError(f"a model with attention {ATTENTION!r} runs on packed sequences: call it "
                           "with the inputs of hflow.workers.packing.pack(...).model_inputs()")
    if dropout > 0:
        raise ValueError("packed attention has no dropout")
    gather, mask, scatter = hflow_packing
    b, L = gather.shape

    def padded(x):  # [1, h, T, D] -> [b, h, L, D]
        h, D = x.shape[1], x.shape[3]
        return x[0].index_select(1, gather.flatten()).view(h, b, L, D).transpose(0, 1)

    out = F.scaled_dot_product_attention(padded(query), padded(key), padded(value), attn_mask=mask,
                                         scale=scaling, enable_gqa=True)   # [b, H, L, D]
    H, D = out.shape[1], out.shape[3]
    out = out.transpose(0, 1).reshape(H, b * L, D).index_select(1, scatter)   # [H, T, D]
    return out.transpose(0, 1).unsqueeze(0).contiguous(), None


def register_attention() -> str:
    """Make `ATTENTION` a transformers attention implementation (idempotent); returns its name.
    The sequence bounds replace the mask, so transformers builds none."""
    AttentionInterface.register(ATTENTION, varlen_attention)
    AttentionMaskInterface.register(ATTENTION, lambda *args, **kwargs: None)
    return ATTENTION


@dataclass
class Packed:
    input_ids: torch.Tensor      # [1, T]
    position_ids: torch.Tensor   # [1, T]
    gather: torch.Tensor         # [b, L] packed index of token j of sequence i (padding: 0)
    attention_mask: torch.Tensor  # [b, 1, L, L] causal, real keys only
    scatter: torch.Tensor        # [T] index of each packed token in the flattened [b, L]
    predict_at: torch.Tensor     # [K] packed indices whose output predicts (or values) a response token
    targets: torch.Tensor        # [K] those response tokens
    rows: torch.Tensor           # [K] where each goes in the [b, R] layout
    cols: torch.Tensor           # [K]
    last: torch.Tensor           # [b] packed index of each sequence's last token
    shape: tuple[int, int]       # (b, R)

    def model_inputs(self) -> dict:
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False,
                "hflow_packing": (self.gather, self.attention_mask, self.scatter)}

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """[K] per-response-token values -> [b, R], 0 where there is no response token."""
        out = values.new_zeros(self.shape)
        return out.index_put((self.rows, self.cols), values)


def pack(tensors: dict[str, torch.Tensor]) -> Packed:
    """Pack the real tokens of a micro-batch in the layout of layout.py, in row order."""
    mask = tensors["attention_mask"].bool()
    b, R = tensors["response_mask"].shape
    P = mask.shape[1] - R
    lengths = mask.sum(1)
    prompt_lengths = mask[:, :P].sum(1)
    if bool((prompt_lengths == 0).any()):
        raise ValueError("a sequence has no prompt token: its first response token is predicted from nothing")
    starts = lengths.cumsum(0) - lengths
    positions = (mask.long().cumsum(1) - 1)[mask]
    rows, cols = mask[:, P:].nonzero(as_tuple=True)
    target_at = starts[rows] + prompt_lengths[rows] + cols
    input_ids = tensors["input_ids"][mask]
    L = int(lengths.max()) if b else 0
    j = torch.arange(L, device=mask.device)
    real = j[None, :] < lengths[:, None]                                    # [b, L]
    gather = torch.where(real, starts[:, None] + j[None, :], 0)
    # a padding query still sees its sequence's real keys (all of them precede it): no empty row
    attention_mask = (j[None, :] <= j[:, None])[None, None] & real[:, None, None, :]
    scatter = (torch.arange(b, device=mask.device)[:, None] * L + j[None, :])[real]
    return Packed(input_ids=input_ids[None], position_ids=positions[None], gather=gather,
                  attention_mask=attention_mask, scatter=scatter, predict_at=target_at - 1,
                  targets=input_ids[target_at], rows=rows, cols=cols, last=starts + lengths - 1,
                  shape=(b, R))
