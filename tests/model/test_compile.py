"""`torch.compile(model)` for training (what Trainer's `torch_compile=True` does), for every model kind the converter
makes: one graph for the whole forward (fullgraph: a graph break fails), compiled once over several optimizer steps
(no recompiles), and the losses and gradients of the eager model. `aot_eager` traces the forward and the backward as
inductor would, then runs the traced ops themselves, so only the order of a few fp32 sums may differ (here they are
equal bit for bit): the loss within 1e-6 relative (8 ulps), each gradient within 1e-5 of its largest element, room
for three SGD steps of reassociation. Inductor on a GPU:
tests/kernels/test_fused_model.py's CUDA test."""

import pytest
import torch
from torch._dynamo.utils import counters

from tests.helpers.tiny import MODEL_KINDS, tiny_model


STEPS = 3


def train(model, forward, ids, mask):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for _ in range(STEPS):
        loss = forward(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, grads


@pytest.mark.parametrize("kind", list(MODEL_KINDS))
def test_a_compiled_training_step_is_one_graph_compiled_once_with_eager_s_numbers(kind):
    overrides = MODEL_KINDS[kind]
    torch.manual_seed(0)
    ids = torch.randint(3, 97, (2, 24))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a padded row: the mask goes through the graph too
    eager = tiny_model(attn_implementation="sdpa", **overrides).train()
    losses, grads = train(eager, eager, ids, mask)

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(attn_implementation="sdpa", **overrides).train()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    compiled_losses, compiled_grads = train(model, compiled, ids, mask)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # a recompile or a break adds a graph
    for step in range(STEPS):
        torch.testing.assert_close(compiled_losses[step], losses[step], rtol=1e-6, atol=0)
        for name, grad in grads[step].items():
            scale = grad.abs().max().item()
            torch.testing.assert_close(compiled_grads[step][name], grad, rtol=0, atol=1e-5 * scale, msg=name)
