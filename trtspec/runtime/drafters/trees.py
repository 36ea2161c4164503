"""The token trees drafters propose (drafters/base.Proposal: ``drafts`` with ``parents``, each node's parent among
the drafts, -1 for the row's last token, parents first).

Verification is verify.py's, for trees as for chains: the worker verifies every node in one target call (a tree
mask: engines.base.tree_positions), the row's sampler walks the tree (verify.RowSampler.accept, the walk every
chain takes too) and the engine keeps the accepted path's K/V (Engine.keep_path).

Shapes built here:
- ``branching_tree``: a draft chain with, at each depth, the draft's next likeliest tokens as siblings (leaves)
  of the chain node; a rejected chain token can still be rescued by a sibling. The draft runs exactly its chain
  calls; only the target's call widens. Nodes beyond a budget are dropped by their path's draft probability
  (EAGLE-2's rule: the product of the draft's probabilities along the path estimates the chance the node is
  reached and accepted).
- ``product_tree``: per depth a list of candidate tokens with log-probabilities (Medusa's heads); the Cartesian
  tree of them, grown best-first by path probability up to the budget.
"""

from __future__ import annotations

import heapq

import numpy as np


def branching_tree(chain, chain_lp, siblings, max_nodes: int) -> tuple[list[int], list[int]]:
    """chain [k] tokens with their draft log-probabilities, siblings[j] [(token, logprob), ...] beside chain[j]
    -> (tokens, parents) of at most max_nodes nodes, parents first (-1: the root)."""
    nodes = []  # (-score, depth, is_sibling, token, chain parent depth)
    cum = 0.0
    for j, token in enumerate(chain):
        for t, lp in siblings[j] if j < len(siblings) else ():
            nodes.append((-(cum + lp), j, 1, int(t), j - 1))
        cum += chain_lp[j]
        nodes.append((-cum, j, 0, int(token), j - 1))
    kept = sorted(nodes)[:max_nodes]  # a node's score is at most its parent's: ancestors sort first
    kept.sort(key=lambda n: (n[1], n[2], n[0]))  # by depth, the chain node first
    index_of_chain = {}
    tokens, parents = [], []
    for _, depth, sibling, token, parent_depth in kept:
        if parent_depth >= 0 and parent_depth not in index_of_chain:
            continue  # its chain parent was dropped (only on exact ties)
        parents.append(index_of_chain[parent_depth] if parent_depth >= 0 else -1)
        if not sibling:
            index_of_chain[depth] = len(tokens)
        tokens.append(token)
    return tokens, parents


def product_tree(candidates, max_nodes: int) -> tuple[list[int], list[int]]:
    """candidates[d] [(token, logprob), ...] for depth d (best first) -> the Cartesian tree's max_nodes most
    probable nodes (a node's probability: the product along its path), as (tokens, parents), parents first."""
    tokens, parents, depth_of = [], [], []
    if not candidates or not candidates[0] or max_nodes < 1:
        return tokens, parents
    # frontier: (-path logprob, depth, choice index at that depth, parent node index)
    heap = [(-candidates[0][0][1], 0, 0, -1)]
    while heap and len(tokens) < max_nodes:
        neg, d, c, parent = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(int(candidates[d][c][0]))
        parents.append(parent)
        depth_of.append(d)
        if c + 1 < len(candidates[d]):  # the next sibling
            base = -neg - candidates[d][c][1]
            heapq.heappush(heap, (-(base + candidates[d][c + 1][1]), d, c + 1, parent))
        if d + 1 < len(candidates) and candidates[d + 1]:  # the best child
            heapq.heappush(heap, (neg - candidates[d + 1][0][1], d + 1, 0, node))
    return tokens, parents


def pack_trees(trees, max_nodes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[(tokens, parents) per row] -> drafts [B, K], parents [B, K] (-1 beyond a row's nodes too), counts [B]."""
    b = len(trees)
    counts = [len(t) for t, _ in trees]
    k = max(counts, default=0)
    flat_tokens: list[int] = []
    flat_parents: list[int] = []
    if k:  # padded flat lists, one conversion each (a drafter's host work counts in its round)
        for tokens, par in trees:
            flat_tokens += tokens
            flat_tokens += [0] * (k - len(tokens))
            flat_parents += par
            flat_parents += [-1] * (k - len(par))
    return (np.array(flat_tokens, np.int64).reshape(b, k), np.array(flat_parents, np.int64).reshape(b, k),
            np.array(counts, np.int64))


def depth_of(parents) -> int:
    """The depth of a row's tree (its longest path), from its parents list."""
    depth = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return max(depth, default=0)
