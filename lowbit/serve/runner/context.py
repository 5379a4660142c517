"""The one per-step context the model reads: where each new token's K/V go and what each query attends to."""
from dataclasses import dataclass, replace

import torch


@dataclass
class StepContext:
    positions: torch.Tensor  # [T] int64: position of each new token in its sequence
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset, where the token's K/V are stored
    query_start_loc: torch.Tensor  # [B+1] int32: new tokens of sequence b are rows [qsl[b], qsl[b+1])
    context_lens: torch.Tensor  # [B] int32: keys sequence b attends to after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    logits_indices: torch.Tensor  # [R] int64: rows whose logits are computed
    is_decode: bool  # every sequence has exactly one new token
    query_lens_cpu: list[int]  # host copies, so reference paths never synchronise with the device
    context_lens_cpu: list[int]
    kinds: tuple = ()  # the contexts of layer kinds 1, 2, ... (their own slots and block tables), see for_kind

    def with_kinds(self, kinds: list[tuple[torch.Tensor, torch.Tensor]]) -> "StepContext":
        """Sets the (slot_mapping, block_tables) of layer kinds 1, 2, ... (KV pools of their own); returns self."""
        self.kinds = tuple(replace(self, slot_mapping=s, block_tables=t, kinds=()) for s, t in kinds)
        return self

    def for_kind(self, kind: int) -> "StepContext":
        """The context an attention layer of KV kind `kind` reads: this one for kind 0."""
        return self if kind == 0 else self.kinds[kind - 1]
