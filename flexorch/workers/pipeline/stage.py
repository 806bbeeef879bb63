"""One pipeline stage's part of the model and its unit forward/backward, with Seq1F1B's K/V prefix cache.

A stage owns layers [first_layer, last_layer) of the decoder (its own copies of their parameters, named as in the
full model); stage 0 also owns the token embedding, the last stage the final norm and the LM head (and, with tied
embeddings, its own copy of the embedding weight: the two copies' gradients are summed after the step, as Megatron
does). Running unit u (pieces of sequences, ``flexorch.solver.pipeline.chunking.Unit``):

* forward: stage 0 embeds the unit's tokens; other stages take the previous stage's hidden states ``(t, dim)`` as a
  leaf that will receive their gradient. Each layer's attention is ``flexorch.workers.attention.segment``: pieces attend
  to their own tokens causally and to the cached K/V of their sequence's earlier segments. The layer's own K/V (after
  RoPE) go into the cache as detached leaves, so the gradient later segments produce for them lands in ``.grad``. The
  last stage computes the unit's summed next-token loss divided by the step's predicted tokens (labels come from the
  whole sequence: a segment's last token predicts the next segment's first token).
* backward: one ``torch.autograd.backward`` over the stage output (with the next stage's gradient, or the loss) and
  the unit's own K/V (with the gradient that later segments left in the cache leaves), so a segment's backward must
  run after those of its sequence's later segments (``flexorch.solver.pipeline.schedule`` orders them so).
* activation checkpointing: the first ``checkpointed`` layers of the stage run under
  ``torch.utils.checkpoint`` (non-reentrant): only their inputs stay, they are recomputed in backward.

Sequence parallelism inside a stage (``sp_group`` of d workers, Ulysses): the unit's t tokens are padded to
``t_pad = ceil(t / d) * d`` and rank j of the stage holds tokens ``[j * t_pad / d, (j + 1) * t_pad / d)``; the
hidden states between stages are those shards. In attention an all-to-all gives each rank all t tokens of ``h / d``
heads, so the segment attention and the K/V prefix cache work on head slices of whole units (the cache of a rank
holds its own heads), and a second all-to-all returns the token shards. Padding tokens have label -100 and are
dropped before attention.

Shapes: hidden ``(t, dim)`` with t the unit's tokens (pieces back to back; ``(t_pad / d, dim)`` with SP); q
``(t, h, hd)``, k/v ``(t, h_kv, hd)``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from flexorch.config.model import ModelConfig
from flexorch.workers.activation_memory import saved_tensor_meter
from flexorch.workers.attention.segment import segment_attn_func
from flexorch.workers.attention.ulysses import head_to_seq, seq_to_head
from flexorch.workers.chunked_loss import LMHead, head_loss_sum
from flexorch.workers.model import Block, Decoder, RMSNorm, rope_cos_sin, stored_token_ids

__all__ = ["StageModule", "UnitInput", "KVCache", "shard_tokens"]


class UnitInput:
    """A unit's tokens as the stages need them: ids, positions and labels of its pieces, back to back."""

    def __init__(self, pieces, sequences: list[torch.Tensor]):
        """``pieces``: ``flexorch.solver.pipeline.chunking.Piece`` list; ``sequences[i]``: the tokens (int64) of
        sequence i as stored (``flexorch.data.targets``: a token that is not a loss target is ``~id``)."""
        self.pieces = [(p.seq, p.start, p.end) for p in pieces]
        ids, pos, labels = [], [], []
        for seq, a, b in self.pieces:
            s = sequences[seq]
            ids.append(stored_token_ids(s[a:b]))
            pos.append(torch.arange(a, b, dtype=torch.int64))
            lab = torch.full((b - a,), -100, dtype=torch.int64)
            nxt = s[a + 1 : b + 1]  # the token after each position, inside the same sequence
            lab[: nxt.numel()] = torch.where(nxt < 0, -100, nxt)  # a next token that is not a target: no loss
            labels.append(lab)
        self.ids, self.pos, self.labels = torch.cat(ids), torch.cat(pos), torch.cat(labels)
        self.lens = [b - a for _, a, b in self.pieces]
        self.prefix = [a for _, a, _ in self.pieces]
        self.tokens = sum(self.lens)

    def shard(self, j: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, positions, labels) of rank j of d: tokens ``[j * t_pad / d, (j + 1) * t_pad / d)`` of the unit
        padded to ``t_pad = ceil(t / d) * d`` (padding: id 0, position 0, label -100)."""
        if d == 1:
            return self.ids, self.pos, self.labels
        n = -(-self.tokens // d)
        pad = n * d - self.tokens
        ids, pos, lab = (F.pad(x, (0, pad), value=v) for x, v in ((self.ids, 0), (self.pos, 0), (self.labels, -100)))
        return ids[j * n : (j + 1) * n], pos[j * n : (j + 1) * n], lab[j * n : (j + 1) * n]


def shard_tokens(tokens: int, degree: int) -> int:
    """Tokens each of ``degree`` stage workers holds of a unit of ``tokens`` (padded to a multiple of degree)."""
    return -(-tokens // degree)


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

    def drop(self, layer: int, seq: int, start: int) -> None:
        """Forget one segment's K/V (after its backward, the last use)."""
        entries = self._store.get((layer, seq), [])
        entries[:] = [e for e in entries if e[0] != start]
        if not entries:
            self._store.pop((layer, seq), None)

    def clear(self) -> None:
        self._store.clear()


class StageModule(torch.nn.Module):
    """Layers [first, last) of a decoder (plus embedding on stage 0, norm and head on the last stage)."""

    def __init__(
        self,
        cfg: ModelConfig,
        first: int,
        last: int,
        stage: int,
        stages: int,
        *,
        model: Decoder | None = None,
        sp_group: dist.ProcessGroup | None = None,
    ):
        """``model``: share that decoder's modules (parameters and their gradients) instead of owning copies, as a
        worker that keeps a whole replica does; ``sp_group``: the stage's workers, for SP inside the stage."""
        super().__init__()
        if not 0 <= first < last <= cfg.num_layers:
            raise ValueError(f"stage layers [{first}, {last}) are not inside the model's {cfg.num_layers} layers")
        self.cfg, self.first, self.last = cfg, first, last
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        self.sp_group = sp_group
        self.sp_degree = dist.get_world_size(sp_group) if sp_group is not None else 1
        self.sp_rank = dist.get_rank(sp_group) if sp_group is not None else 0
        if self.is_first:
            self.tok_embeddings = model.tok_embeddings if model else torch.nn.Embedding(cfg.vocab_size, cfg.dim)
        else:
            self.tok_embeddings = None
        self.layers = torch.nn.ModuleDict(
            {str(i): model.layers[i] if model else Block(cfg) for i in range(first, last)}
        )
        if self.is_last:
            self.norm = model.norm if model else RMSNorm(cfg.dim, cfg.norm_eps)
            if cfg.tie_embeddings:
                self.head_weight = (
                    model.tok_embeddings.weight if model else torch.nn.Parameter(torch.empty(cfg.vocab_size, cfg.dim))
                )
            else:
                self.output = model.output if model else LMHead(cfg.dim, cfg.vocab_size)
        self.inner_checkpoint = False
        """Checkpointed layers recompute inside their own forward (``Block.recompute = "full"``; FSDP2 units, whose
        call must not run twice) instead of under a ``checkpoint`` around the call."""
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

        d, group = self.sp_degree, self.sp_group

        def attn(q, k, v):
            if d > 1:
                return self._sp_attn(q, k, v, seq_attn, unit.tokens, d, group)
            return seq_attn(q, k, v)

        def seq_attn(q, k, v):
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
                own.append((kk, vv, leaf_k, leaf_v, (layer, seq, a)))
                at += b - a
            return out

        return attn

    @staticmethod
    def _sp_attn(q, k, v, seq_attn, tokens: int, d: int, group):
        """Ulysses around the segment attention: ``(t_pad/d, h, hd)`` shards -> whole unit, ``h/d`` heads -> back."""
        h_kv = k.shape[1]
        if (
            h_kv % d
        ):  # GQA with fewer KV heads than d: replicate each KV head (as flexorch.workers.attention.ulysses does)
            rep = math.lcm(h_kv, d) // h_kv
            k = k.repeat_interleave(rep, dim=1)  # (t_pad/d, h_kv, hd) -> (t_pad/d, lcm(h_kv, d), hd)
            v = v.repeat_interleave(rep, dim=1)
        q_h = seq_to_head(q, group)[:tokens]  # (t_pad/d, h, hd) -a2a-> (t_pad, h/d, hd) -> (t, h/d, hd)
        k_h = seq_to_head(k, group)[:tokens]  # (t_pad/d, h_kv', hd) -a2a-> (t, h_kv'/d, hd)
        v_h = seq_to_head(v, group)[:tokens]
        out = seq_attn(q_h, k_h, v_h)  # (t, h/d, hd)
        pad = q.shape[0] * d - tokens
        out = F.pad(out, (0, 0, 0, 0, 0, pad))  # (t, h/d, hd) -> (t_pad, h/d, hd)
        return head_to_seq(out, group)  # (t_pad, h/d, hd) -a2a-> (t_pad/d, h, hd)

    def forward_unit(
        self, u: int, unit: UnitInput, x_in: torch.Tensor | None, n_predicted: int, checkpointed: int = 0
    ) -> torch.Tensor:
        """Run unit ``u`` forward; returns the hidden states for the next stage (detached) or, on the last stage,
        the unit's loss share (a float tensor, detached)."""
        dev = self.layers[str(self.first)].attention.wq.weight.device
        # (t,) each, or this rank's (t_pad/d,) shard, on the stage's device
        ids, pos, labels = (x.to(dev) for x in unit.shard(self.sp_rank, self.sp_degree))
        if self.is_first:
            x = self.tok_embeddings(ids)  # (t,) -> (t, dim)
            leaf = None
        else:
            leaf = x_in.detach().requires_grad_()
            x = leaf
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta)  # (t, hd/2) each
        own: list = []
        kept = 0  # inputs of checkpointed layers: all they keep (the meter does not see checkpoint's own storage)
        with saved_tensor_meter(self.parameters()) as meter:
            for i in range(self.first, self.last):
                block = self.layers[str(i)]
                attn = self._attn(i, unit, own)
                if i - self.first < checkpointed and self.inner_checkpoint:
                    block.recompute = "full"  # its inputs are reported to the meter (flexorch.workers.recompute)
                    x = block(x, cos, sin, attn)
                    block.recompute = "none"
                elif i - self.first < checkpointed:
                    kept += x.numel() * x.element_size()
                    x = checkpoint(block, x, cos, sin, attn, use_reentrant=False)
                else:
                    x = block(x, cos, sin, attn)
            if self.is_last:
                h = self.norm(x)
                # the head fused with the loss in chunks (flexorch.workers.chunked_loss): no (t, vocab) logits held;
                # untied through the head's own method (a sharded head's FSDP unit gathers around it)
                chunk = self.cfg.loss_chunk_tokens
                if self.cfg.tie_embeddings:
                    out = head_loss_sum(h, self.head_weight, labels, chunk) / n_predicted
                else:
                    out = self.output.loss_sum(h, labels, chunk) / n_predicted
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
        for kk, vv, leaf_k, leaf_v, _ in saved["own"]:
            for t, leaf in ((kk, leaf_k), (vv, leaf_v)):
                if leaf.grad is not None:  # later segments attended to these K/V
                    tensors.append(t)
                    grads.append(leaf.grad)
        torch.autograd.backward(tensors, grads)
        for *_, key in saved["own"]:  # later segments ran backward before this one: nobody needs these K/V now
            self.cache.drop(*key)
        self.held_bytes -= saved["bytes"]
        return None if saved["leaf"] is None else saved["leaf"].grad

    def reset_peak(self) -> None:
        self.peak_held_bytes = self.held_bytes

    def end_step(self) -> None:
        if self._units:
            raise RuntimeError(f"units {sorted(self._units)} ran forward but not backward this step")
        self.cache.clear()
