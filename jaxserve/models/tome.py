"""ToMe token merging (Bolya et al., "Token Merging: Your ViT but Faster", ICLR 2023).

Bipartite soft matching (ToMe §3, "Token Merging"): the mergeable tokens alternate into sets A and B,
each A token picks its most similar B token (cosine similarity of the attention keys, averaged over
heads), the r most similar edges are kept, and each chosen A token is folded into its B partner by a
size-weighted average. Sizes are tracked so that later layers can use proportional attention
(ToMe §3, "Tracking Token Size": log(size) is added to the attention logits of each key).

Everything is static-shaped: r and the number of protected tokens are Python ints, so a merge schedule
compiles into one executable per (shape, r) and contains no data-dependent shapes.

Protected tokens. A sequence here is laid out as [CLS, prompt tokens..., patch tokens...]. The first
`num_protected` tokens (CLS and any OTAS prompt tokens) are never merged, neither as a source nor as a
destination: CLS because the classifier reads it (as in ToMe, which protects the class token), prompts
because OTAS prompt layers must find and replace them at known positions, and because merging a
task-specific prompt into an image token would mix per-task parameters into image content. They stay in
place at the front of the sequence; only patch tokens are matched.

Where we differ from the reference implementation: ToMe keeps CLS inside set A with similarity -inf and
re-sorts; we slice the protected prefix off instead, which keeps it in place for any prefix length and
makes the protection structural rather than numerical. The output order of the merged part is ToMe's:
[unmerged A tokens in original order, then all B tokens].
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class MergePlan(NamedTuple):
    """Where each token of the merged sequence comes from (absolute positions in the input).

    kept_idx: [B, T - r] input position that seeds each output slot (protected prefix, unmerged A, all B).
    src_idx:  [B, r]     input positions of the A tokens that are merged away.
    dst_slot: [B, r]     output slot (index into kept_idx) each merged-away token is added to.
    """

    kept_idx: jax.Array
    src_idx: jax.Array
    dst_slot: jax.Array


def clamp_merge_r(r: int, num_tokens: int, num_protected: int) -> int:
    """Largest r the bipartite split allows: at most one merge per B token (ToMe clamps to half)."""
    mergeable = max(num_tokens - num_protected, 0)
    return max(0, min(int(r), mergeable // 2))


def bipartite_soft_matching(metric: jax.Array, r: int, num_protected: int = 1) -> MergePlan:
    """Plan the merge of r tokens per sample (ToMe §3, "Bipartite Soft Matching").

    metric: [B, T, C] per-token features to match on (keys averaged over heads); r is clamped with
    `clamp_merge_r`. The first `num_protected` tokens are never merged (see module docstring).
    When the clamped r is 0 (e.g. a single mergeable token, so set B is empty) the plan is the
    identity, which `merge_wavg` skips.
    """
    batch, num_tokens, _ = metric.shape
    r = clamp_merge_r(r, num_tokens, num_protected)
    if r == 0:
        empty = jnp.zeros((batch, 0), jnp.int32)
        kept_idx = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32), (batch, num_tokens))
        return MergePlan(kept_idx=kept_idx, src_idx=empty, dst_slot=empty)
    a_pos = jnp.arange(num_protected, num_tokens, 2)  # set A: every other mergeable token
    b_pos = jnp.arange(num_protected + 1, num_tokens, 2)  # set B: the ones in between
    num_a, num_b = a_pos.shape[0], b_pos.shape[0]

    metric = metric / jnp.linalg.norm(metric, axis=-1, keepdims=True).clip(1e-12)
    scores = jnp.einsum("bic,bjc->bij", metric[:, a_pos], metric[:, b_pos])  # [B, |A|, |B|]
    node_max = scores.max(axis=-1)
    node_idx = scores.argmax(axis=-1)  # best B partner of each A token
    edge_order = jnp.argsort(-node_max, axis=-1, stable=True)  # most similar edges first
    src_a = edge_order[:, :r]  # A tokens merged away
    unm_a = jnp.sort(edge_order[:, r:], axis=-1)  # A tokens kept, in original order
    dst_b = jnp.take_along_axis(node_idx, src_a, axis=-1)

    prefix = jnp.broadcast_to(jnp.arange(num_protected), (batch, num_protected))
    kept_idx = jnp.concatenate(
        [prefix, a_pos[unm_a], jnp.broadcast_to(b_pos, (batch, num_b))], axis=1
    )
    dst_slot = num_protected + (num_a - r) + dst_b
    return MergePlan(kept_idx=kept_idx, src_idx=a_pos[src_a], dst_slot=dst_slot)


def merge_wavg(plan: MergePlan, x: jax.Array, size: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Apply a plan: size-weighted average of merged tokens (ToMe §3, "Tracking Token Size").

    x: [B, T, D]; size: [B, T] tokens each row stands for. Returns ([B, T - r, D], [B, T - r]); the
    sizes still sum to the original token count. A plan that merges nothing returns (x, size).
    """
    if plan.src_idx.shape[-1] == 0:
        return x, size

    def one(kept_idx, src_idx, dst_slot, x, size):
        weighted = x * size[:, None]
        out = weighted[kept_idx].at[dst_slot].add(weighted[src_idx])
        out_size = size[kept_idx].at[dst_slot].add(size[src_idx])
        return out / out_size[:, None], out_size

    return jax.vmap(one)(plan.kept_idx, plan.src_idx, plan.dst_slot, x, size)
