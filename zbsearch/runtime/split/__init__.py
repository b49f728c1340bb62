"""The backward pass split into B (input gradient) and W (weight gradient), for any module.

Zero Bubble schedules run a stage's backward as two passes: B, which the previous stage waits
for, and W, which can fill a bubble later. This package makes those passes from one ordinary
forward of any ``nn.Module``, with gradients bit for bit those of ``loss.backward()``
microbatch after microbatch::

    fp = forward_pass(stage, inputs)                    # F
    input_grads, w = backward_input(fp, output_grads)   # B: returns W's work
    backward_weight(w)                                  # W: accumulates into .grad

or ``backward_full(fp, output_grads)`` for a fused BW. ``docs/split-backward.md`` says what is
exact, what is refused, and how hooks and checkpointing behave. Modules:

``passes``        the pass API, ``ForwardPass`` / ``WeightPass``, and how each signature runs
``deferred``      the fast path: Linear weight gradients deferred to W, the rest in one B call
``graph_cut``     the generic split: per-use views and the graph cut into B's part and W's
``accumulation``  gradients added up in autograd's order, parameter hooks run as there
"""

from .passes import (
    ForwardPass,
    WeightPass,
    backward_full,
    backward_in_w,
    backward_input,
    backward_weight,
    compiled,
    forward_pass,
    fused_forward,
)

__all__ = [
    "ForwardPass", "WeightPass", "forward_pass", "backward_input", "backward_weight", "backward_full", "backward_in_w",
    "fused_forward", "compiled",
]
