"""One pipeline stage's part of the model and its unit forward/backward, with Seq1F1B's K/V prefix cache.

A stage owns layers [first_layer, last_layer) of the decoder (its own copies of their parameters, named as in the
full model); stage 0 also owns the token embedding, the last stage the final norm and the LM head (and, with tied
embeddings, its own copy of the embedding weight: the two copies' gradients are summed after the step, as Megatron
does). Running unit u (pieces of sequences, ``solver.chunking.Unit``):

* forward: stage 0 embeds the unit's tokens; other stages take the previous stage's hidden states ``(t, dim)`` as a
  leaf that will receive their gradient. Each layer's attention is ``workers.segment_attn``: pieces attend to their
  own tokens causally and to the cached K/V of their sequence's earlier segments. The layer's own K/V (after RoPE)
  go into the cache as detached leaves, so the gradient later segments produce for them lands in ``.grad``. The
  last stage computes the unit's summed next-token loss divided by the step's predicted tokens (labels come from the
  whole sequence: a segment's last token predicts the next segment's first token).
* backward: one ``torch.autograd.backward`` over the stage output (with the next stage's gradient, or the loss) and
  the unit's own K/V (with the gradient that later segments left in the cache leaves), so a segment's backward must
  run after those of its sequence's later segments (``solver.pipeline_schedule`` orders them so).
* activation checkpointing: the first ``checkpointed`` layers of the stage run under
  ``torch.utils.checkpoint`` (non-reentrant): only their inputs stay, they are recomputed in backward.

Shapes: hidden ``(t, dim)`` with t the unit's tokens (pieces back to back); q ``(t, h, hd)``, k/v ``(t, h_kv, hd)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from workers.activation_memory import saved_tensor_meter
from workers.model import Block, Decoder, ModelConfig, RMSNorm, loss_sum, rope_cos_sin
from workers.segment_attn import segment_attn_func

__all__ = ["StageModule", "UnitInput", "KVCache"]


class UnitInput:
    """A unit's tokens as the stages need them: ids, positions and labels of its pieces, back to back."""

    def __init__(self, pieces, sequences: list[torch.Tensor]):
        """``pieces``: ``solver.chunking.Piece`` list; ``sequences[i]``: the token ids (int64) of sequence i."""
        self.pieces = [(p.seq, p.start, p.end) for p in pieces]
        ids, pos, labels = [], [], []
        for seq, a, b in self.pieces:
            s = sequences[seq]
            ids.append(s[a:b])
            pos.append(torch.arange(a, b, dtype=torch.int64))
            lab = torch.full((b - a,), -100, dtype=torch.int64)
            nxt = s[a + 1 : b + 1]  # the token after each position, inside the same sequence
            lab[: nxt.numel()] = nxt
            labels.append(lab)
        self.ids, self.pos, self.labels = torch.cat(ids), torch.cat(pos), torch.cat(labels)
        self.lens = [b - a for _, a, b in self.pieces]
        self.prefix = [a for _, a, _ in self.pieces]


class KVCache:
    """Per layer and sequence, the K/V leaves of the segments run so far (start, end, k, v)."""

    def __init__(self) -> None:
        self._store: dict[tuple[int, int], list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}

    def prefix(self, layer: int, seq: int, start: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        entries = sorted(self._store.get((layer, seq), []), key=lambda e: e[0])
        ks, vs, at = [], [], 0
        for a, b, k, v in entries:
            if b > start:
                break
            if a != at:
                raise RuntimeError(f"layer {layer}, sequence {seq}: the K/V cache has a gap at token {at}")
            ks.append(k)
            vs.append(v)
            at = b
        if at != start:
            raise RuntimeError(
                f"layer {layer}, sequence {seq}: a segment starting at token {start} needs the K/V of tokens "
                f"[0, {start}), the cache has [0, {at}): run the sequence's segments in order"
            )
        return ks, vs

    def put(self, layer: int, seq: int, start: int, end: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._store.setdefault((layer, seq), []).append((start, end, k, v))

    def leaf(self, layer: int, seq: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        for a, _, k, v in self._store[(layer, seq)]:
            if a == start:
                return k, v
        raise KeyError((layer, seq, start))

    def clear(self) -> None:
        self._store.clear()


class StageModule(torch.nn.Module):
    """Layers [first, last) of a decoder (plus embedding on stage 0, norm and head on the last stage)."""

    def __init__(self, cfg: ModelConfig, first: int, last: int, stage: int, stages: int):
        super().__init__()
        if not 0 <= first < last <= cfg.num_layers:
            raise ValueError(f"stage layers [{first}, {last}) are not inside the model's {cfg.num_layers} layers")
        self.cfg, self.first, self.last = cfg, first, last
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        self.tok_embeddings = torch.nn.Embedding(cfg.vocab_size, cfg.dim) if self.is_first else None
        self.layers = torch.nn.ModuleDict({str(i): Block(cfg) for i in range(first, last)})
        if self.is_last:
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            if cfg.tie_embeddings:
                self.head_weight = torch.nn.Parameter(torch.empty(cfg.vocab_size, cfg.dim))
            else:
                self.output = torch.nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self._units: dict[int, dict] = {}
        self.cache = KVCache()
        self.held_bytes = 0
        """Activation bytes this stage holds for backward now (units run forward, not yet backward)."""
        self.peak_held_bytes = 0
        """Most activation bytes held at once since the last :meth:`reset_peak`."""

    # ---------------------------------------------------------------- parameters <-> the full model
    def full_name(self, name: str) -> str:
        """This stage's parameter name as the full :class:`Decoder` names it."""
        if name.startswith("layers."):
            return name  # ModuleDict keys are the global layer indices
        if name == "head_weight":
            return "tok_embeddings.weight"
        return name

    def load_from(self, model: Decoder) -> StageModule:
        full = dict(model.named_parameters())
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(full[self.full_name(name)])
        return self

    # ---------------------------------------------------------------- one unit
    def _attn(self, layer: int, unit: UnitInput, own: list):
        first_call = [True]  # a checkpointed layer runs again in backward: no second cache entry then

        def attn(q, k, v):
            ks, vs = [], []
            for seq, a, _ in unit.pieces:
                pk, pv = self.cache.prefix(layer, seq, a) if a > 0 else ([], [])
                ks += pk
                vs += pv
            kp = torch.cat(ks) if ks else k[:0]
            vp = torch.cat(vs) if vs else v[:0]
            out = segment_attn_func(q, k, v, unit.lens, unit.prefix, kp, vp)
            if not first_call[0]:
                return out
            first_call[0] = False
            at = 0
            for seq, a, b in unit.pieces:
                kk, vv = k[at : at + b - a], v[at : at + b - a]
                leaf_k, leaf_v = kk.detach().requires_grad_(), vv.detach().requires_grad_()
                self.cache.put(layer, seq, a, b, leaf_k, leaf_v)
                own.append((kk, vv, leaf_k, leaf_v))
                at += b - a
            return out

        return attn

    def forward_unit(
        self, u: int, unit: UnitInput, x_in: torch.Tensor | None, n_predicted: int, checkpointed: int = 0
    ) -> torch.Tensor:
        """Run unit ``u`` forward; returns the hidden states for the next stage (detached) or, on the last stage,
        the unit's loss share (a float tensor, detached)."""
        if self.is_first:
            x = self.tok_embeddings(unit.ids)  # (t,) -> (t, dim)
            leaf = None
        else:
            leaf = x_in.detach().requires_grad_()
            x = leaf
        cos, sin = rope_cos_sin(unit.pos, self.cfg.head_dim, self.cfg.rope_theta)  # (t, hd/2) each
        own: list = []
        kept = 0  # inputs of checkpointed layers: all they keep (the meter does not see checkpoint's own storage)
        with saved_tensor_meter(self.parameters()) as meter:
            for i in range(self.first, self.last):
                block = self.layers[str(i)]
                attn = self._attn(i, unit, own)
                if i - self.first < checkpointed:
                    kept += x.numel() * x.element_size()
                    x = checkpoint(block, x, cos, sin, attn, use_reentrant=False)
                else:
                    x = block(x, cos, sin, attn)
            if self.is_last:
                h = self.norm(x)
                weight = self.head_weight if self.cfg.tie_embeddings else self.output.weight
                logits = F.linear(h, weight).float()  # (t, dim) x (vocab, dim)^T -> (t, vocab)
                out = loss_sum(logits, unit.labels) / n_predicted
                del logits
            else:
                out = x
        held = meter.bytes + kept
        self.held_bytes += held
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        self._units[u] = {"out": out, "leaf": leaf, "own": own, "bytes": held}
        return out.detach()

    def backward_unit(self, u: int, grad_out: torch.Tensor | None) -> torch.Tensor | None:
        """Run unit ``u`` backward; returns the gradient of its input hidden states (for the previous stage)."""
        saved = self._units.pop(u)
        tensors, grads = [saved["out"]], [grad_out if not self.is_last else torch.ones_like(saved["out"])]
        for kk, vv, leaf_k, leaf_v in saved["own"]:
            for t, leaf in ((kk, leaf_k), (vv, leaf_v)):
                if leaf.grad is not None:  # later segments attended to these K/V
                    tensors.append(t)
                    grads.append(leaf.grad)
        torch.autograd.backward(tensors, grads)
        self.held_bytes -= saved["bytes"]
        return None if saved["leaf"] is None else saved["leaf"].grad

    def reset_peak(self) -> None:
        self.peak_held_bytes = self.held_bytes

    def end_step(self) -> None:
        if self._units:
            raise RuntimeError(f"units {sorted(self._units)} ran forward but not backward this step")
        self.cache.clear()
