"""The autograd nodes one api or module call created, and where its input gradients leave them.

An api call can make several autograd nodes (F.linear: a transpose and a matmul; a composite
op such as scaled_dot_product_attention: a dozen, and which ones depends on the kernel it took);
a module call makes all of its layers' nodes. Its backward, as the dump and the overflow
detector report it, is all of them together: the gradients coming in at its outputs' nodes, and
the gradients going out along the edges to its inputs' producers -- whatever the graph looks
like inside.
"""

from __future__ import annotations

import torch

# A bound on the graph walk of one op. A composite op makes as many nodes as the work it does
# (an LSTM: several per time step and layer), so the bound is only a guard against runaway walks.
_MAX_NODES_PER_OP = 50_000


def nodes_after(floor: int, outputs: list[torch.Tensor], limit: int, exclude: set[int] = frozenset()) -> list:
    """The autograd nodes behind `outputs` made after sequence number `floor`: walking back from
    the outputs' nodes, a node older than that (an input's node) or an AccumulateGrad (a leaf) ends
    the walk. `exclude`: ids of output tensors whose node is not theirs (an input passed through).
    No nodes when there are more than `limit`: a part of the graph would give partial gradient sums."""
    own = [t.grad_fn for t in outputs if t.grad_fn is not None and id(t) not in exclude]
    pending = list(own)
    visited: list = []  # keeps every visited node alive so ids stay unique during the walk
    seen: set[int] = set()
    nodes = []
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        visited.append(node)
        if type(node).__name__ == "AccumulateGrad" or node._sequence_nr() <= floor:
            continue
        if cast_leaf(node) is not None and all(node is not mine for mine in own):
            continue  # the weight's cast: the call's gradient for the weight is what enters it
        nodes.append(node)
        if len(nodes) > limit:
            return []
        pending.extend(next_node for next_node, _ in node.next_functions)
    return nodes


def cast_leaf(node):
    """The leaf tensor (a weight) that `node` casts to another dtype, or None. Autocast casts a
    weight once per region and every later call reuses that cast, so its node sums the gradients
    of all the calls: the one call's gradient for the weight is the one that enters the cast."""
    if type(node).__name__ != "ToCopyBackward0":
        return None
    following = node.next_functions
    if len(following) == 1 and following[0][0] is not None and type(following[0][0]).__name__ == "AccumulateGrad":
        return following[0][0].variable
    return None


def producers(inputs: list[torch.Tensor]) -> list[tuple]:
    """(node, output_nr, requires_grad) of each input as it is now. Taken before a call that
    changes an input in place: that gives the tensor a new node, made by the call."""
    return [(t.grad_fn, t.output_nr, t.requires_grad) for t in inputs]


def newest_input_node(inputs: list[torch.Tensor], before: list[tuple] | None = None) -> int:
    """Sequence number of the newest node among the inputs' producers (-1 for none)."""
    nodes = [node for node, _, _ in before] if before is not None else [t.grad_fn for t in inputs]
    return max((node._sequence_nr() for node in nodes if node is not None), default=-1)


class OpNodes:
    """Finds the nodes each api call created, in call order (one instance per thread of ops):
    those newer than both its inputs' producers and every earlier call's nodes."""

    def __init__(self) -> None:
        self.floor = -1  # sequence number of the newest node of an earlier op

    def created(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor], before: list[tuple] | None = None) -> list:
        """before: the inputs' producers() taken before an in-place call."""
        floor = max(self.floor, newest_input_node(inputs, before))
        # An op returning its input unchanged shares the producer's node: not its own.
        unchanged = {id(t) for t, (node, _, _) in zip(inputs, before or producers(inputs)) if t.grad_fn is node}
        nodes = nodes_after(floor, outputs, _MAX_NODES_PER_OP, exclude=unchanged)
        if nodes:
            self.floor = max(floor, max(node._sequence_nr() for node in nodes))
        return nodes


def input_edges(nodes: list, inputs: list[torch.Tensor], before: list[tuple] | None = None) -> dict[int, list[tuple[int, int]]]:
    """For each node (by index in `nodes`): [(edge index, input position)] of the edges that carry
    the op's gradient to one of its inputs. An input passed twice (x * x) gets its edges in order.
    before: the inputs' producers() taken before an in-place call."""
    wanted: dict[tuple, list[int]] = {}  # producer key -> input positions, in argument order
    for position, (tensor, (node, output_nr, requires_grad)) in enumerate(zip(inputs, before or producers(inputs))):
        if requires_grad:
            key = ("node", id(node), output_nr) if node is not None else ("leaf", id(tensor))
            wanted.setdefault(key, []).append(position)
    inside = {id(node) for node in nodes}
    taken: dict[tuple, int] = {}
    edges: dict[int, list[tuple[int, int]]] = {}
    for index, node in enumerate(nodes):
        for edge, (target, input_nr) in enumerate(node.next_functions):
            if target is None or id(target) in inside:
                continue
            leaf = target.variable if type(target).__name__ == "AccumulateGrad" else cast_leaf(target)
            key = ("leaf", id(leaf)) if leaf is not None else ("node", id(target), input_nr)
            positions = wanted.get(key)
            if positions is None:
                continue
            used = taken.get(key, 0)
            taken[key] = used + 1
            edges.setdefault(index, []).append((edge, positions[min(used, len(positions) - 1)]))
    return edges
