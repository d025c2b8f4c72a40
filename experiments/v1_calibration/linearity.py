"""How far V1's per-head sub-layer norm is from linear at step 0 in the expanded layout (docs/converting.md, "Step 0
on other domains"; issue 47): per layer of SOURCE, on 4 blocks of 256 tokens of the Python Language Reference, the
relative error of the best per-head constant map from the source heads' outputs y1 = A1 v1 to the normalised heads
y1 / rms([y1 | y2]), with the second value half y2 as the layout's small noise and as the steady channel of
`conversion.fit._steady_second_half` (x along u = C⁻¹m) at k = 1, 3 and 10 times the first half's norm.

    python experiments/v1_calibration/linearity.py SOURCE_DIR
"""

import sys
from pydoc_data.topics import topics

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def linearity_error(y1: torch.Tensor, y2: torch.Tensor, d: int) -> float:
    """Relative error of the best per-head constant c_h in y1 / rms([y1 | y2]) ≈ c_h y1; y1, y2 (B, H, N, ·)."""
    rms = ((y1.pow(2).sum(-1) + y2.pow(2).sum(-1)) / (2 * d)).sqrt()[..., None]
    normed = y1 / rms
    gain = (normed * y1).sum(dim=(0, 2, 3), keepdim=True) / (y1 * y1).sum(dim=(0, 2, 3), keepdim=True)  # per head
    return ((normed - gain * y1).norm() / normed.norm()).item()


def main(source: str) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager", dtype=torch.float32).eval()
    ids = tokenizer("\n\n".join(topics[name] for name in sorted(topics)), add_special_tokens=False)["input_ids"]
    blocks = torch.tensor([ids[i * 5000 : i * 5000 + 256] for i in range(4)])  # (4, 256)
    config = model.config
    H, H_kv = config.num_attention_heads, config.num_key_value_heads
    d = config.hidden_size // H
    inputs = {}
    for i, layer in enumerate(model.model.layers):

        def keep(module, args, kwargs, i=i):
            inputs[i] = kwargs["hidden_states"].detach()

        layer.self_attn.register_forward_pre_hook(keep, with_kwargs=True)
    with torch.no_grad():
        maps = model(blocks, output_attentions=True).attentions  # per layer (B, H, N, N)
        for i in sorted({*range(0, config.num_hidden_layers, 5), config.num_hidden_layers - 1}):
            x, A = inputs[i], maps[i]  # (B, N, D): the attention's normalised input
            v = model.model.layers[i].self_attn.v_proj(x).view(*x.shape[:2], H_kv, d).transpose(1, 2)
            y1 = A @ v.repeat_interleave(H // H_kv, dim=1)  # (B, H, N, d)
            flat = x.reshape(-1, x.shape[-1])
            cov = torch.cov(flat.T)
            cov = cov + 1e-3 * cov.diagonal().mean() * torch.eye(cov.shape[0])
            direction = torch.linalg.solve(cov, flat.mean(0))
            projection = x @ (direction / direction.norm())  # (B, N): nearly constant
            steady = A @ projection[:, None, :, None]  # (B, H, N, 1)
            noise = A @ (0.01 * v.std() * torch.randn_like(v)).repeat_interleave(H // H_kv, dim=1)
            errors = [linearity_error(y1, noise, d)]
            for k in (1, 3, 10):
                errors.append(linearity_error(y1, k * y1.norm(dim=-1).mean() / steady.abs().mean() * steady, d))
            spread = (projection.std() / projection.mean()).item()
            print(
                f"layer {i:2d}: noise {errors[0]:.3f} | steady k=1 {errors[1]:.3f}, k=3 {errors[2]:.3f}, "
                f"k=10 {errors[3]:.3f} | projection's coefficient of variation {spread:.3f}"
            )


if __name__ == "__main__":
    main(sys.argv[1])
