"""The loss on packed sidecar rows: answer tokens only, logits only where there is a label.

`PackedSFTTrainer` is trl's `SFTTrainer` with one change, `compute_loss`: the batch comes from
`packing.PackedCollator` (4-D mask, restarted position ids, answer-only labels), and the LM head runs only at the
positions whose next token is an answer token (transformers' `logits_to_keep` with a boolean [b, L] mask). trl 1.16's
own path (a fused LM head) scores every position of the sequence on devices without Triton (CPU), and always
computes per-token entropy and top-1 over the full vocabulary for its logs; answers are ~5% of a packed sequence,
so here the head costs ~5% of that. The logged `entropy` and `mean_token_accuracy` are computed on the answer
logits only (cheap), with the same names trl uses.

`answer_logits` / `answer_token_losses` are the functions the trainer and the equivalence tests share.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from trl import SFTTrainer

from .packing import IGNORE, additive_mask

MASK_READY_ATTENTION = ("sdpa", "eager")


def _config(model):
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return model.config


def model_inputs(model, batch: dict) -> dict:
    """The forward kwargs for a packed batch, with the mask in the form the model's attention implementation takes."""
    impl = getattr(_config(model), "_attn_implementation", "sdpa") or "sdpa"
    if impl not in MASK_READY_ATTENTION:
        raise ValueError(f"packed sidecar rows need a custom 4-D attention mask, which attn_implementation={impl!r} "
                         f"does not take; use one of {MASK_READY_ATTENTION}")
    mask = batch["attention_mask"]
    if mask.dim() == 2:  # one row per sequence: plain causal attention over the unpadded tokens
        return {"input_ids": batch["input_ids"], "attention_mask": mask, "position_ids": batch["position_ids"]}
    if impl == "eager" and mask.dtype == torch.bool:
        dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
        if torch.is_autocast_enabled(mask.device.type):
            dtype = torch.get_autocast_dtype(mask.device.type)
        mask = additive_mask(mask, dtype)
    return {"input_ids": batch["input_ids"], "attention_mask": mask, "position_ids": batch["position_ids"]}


def answer_logits(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [N, V] at the N positions that predict an answer token, and those tokens [N] (batch order)."""
    labels = batch["labels"]
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)  # position t predicts t+1
    keep = targets != IGNORE  # [b, L]
    out = model(**model_inputs(model, batch), logits_to_keep=keep, use_cache=False)
    return out.logits, targets[keep]


def answer_token_losses(model, batch: dict) -> torch.Tensor:
    """Negative log-likelihood of every answer token [N], at least float32."""
    logits, targets = answer_logits(model, batch)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, targets, reduction="none")


class PackedSFTTrainer(SFTTrainer):
    """SFTTrainer on prefix-shared packed rows (pass `data_collator=PackedCollator(...)` and a packed dataset)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        logits, targets = answer_logits(model, inputs)
        logits32 = logits.to(torch.promote_types(logits.dtype, torch.float32))
        nll = F.cross_entropy(logits32, targets, reduction="sum")
        # Like trl and Trainer: `num_items_in_batch` counts the answer tokens of the whole accumulated batch on every
        # rank, so the gradient is the mean over all of them; DDP/DeepSpeed average across ranks, hence the factor.
        denom = targets.numel() if num_items_in_batch is None else num_items_in_batch
        loss = nll / torch.as_tensor(denom, device=nll.device).clamp(min=1)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes

        with torch.no_grad():
            logp = F.log_softmax(logits32.detach(), dim=-1)
            n = torch.tensor(float(targets.numel()), device=logits.device)
            entropy = -(logp.exp() * logp).sum(-1).sum()
            correct = (logits32.argmax(-1) == targets).sum().float()
            n, entropy, correct = (self.accelerator.gather_for_metrics(x.reshape(1)).sum() for x in (n, entropy, correct))
        self._metrics[mode]["entropy"].append((entropy / n).item() if n > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append((correct / n).item() if n > 0 else 0.0)
        if mode == "train":
            tokens = torch.tensor(float((inputs["position_ids"] > 0).sum() + inputs["position_ids"].shape[0]),
                                  device=logits.device)
            self._total_train_tokens += int(self.accelerator.gather_for_metrics(tokens.reshape(1)).sum().item())
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        return (loss, {"logits": logits}) if return_outputs else loss
