"""End to end: a tiny Llama-style block written with torch_npu's fused ops (npu_rms_norm,
npu_rotary_mul, npu_swiglu) trains on the npu like the same block written with plain torch ops."""

import copy

import torch
import torch.nn.functional as F
import torch_npu

DIM, HEADS, HIDDEN, SEQ, BATCH = 32, 4, 64, 8, 2
HEAD_DIM = DIM // HEADS


class Block(torch.nn.Module):
    def __init__(self, fused: bool):
        super().__init__()
        self.fused = fused
        self.attention_norm = torch.nn.Parameter(torch.ones(DIM))
        self.mlp_norm = torch.nn.Parameter(torch.ones(DIM))
        self.qkv = torch.nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = torch.nn.Linear(DIM, DIM, bias=False)
        self.gate_up = torch.nn.Linear(DIM, 2 * HIDDEN, bias=False)
        self.down = torch.nn.Linear(HIDDEN, DIM, bias=False)

    def rms_norm(self, x, weight):
        if self.fused:
            return torch_npu.npu_rms_norm(x, weight, epsilon=1e-6)[0]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    def rotary(self, x, cos, sin):  # x: (B, S, N, D), cos/sin: (1, S, 1, D)
        if self.fused:
            return torch_npu.npu_rotary_mul(x, cos, sin)
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat((-x2, x1), -1) * sin

    def swiglu(self, x):
        if self.fused:
            return torch_npu.npu_swiglu(x, dim=-1)
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up

    def forward(self, x, cos, sin):
        q, k, v = self.qkv(self.rms_norm(x, self.attention_norm)).view(BATCH, SEQ, 3, HEADS, HEAD_DIM).unbind(2)
        q, k = self.rotary(q, cos, sin), self.rotary(k, cos, sin)
        attention = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=True)
        x = x + self.out(attention.transpose(1, 2).reshape(BATCH, SEQ, DIM))
        return x + self.down(self.swiglu(self.gate_up(self.rms_norm(x, self.mlp_norm))))


def rope_tables():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    angles = torch.outer(torch.arange(SEQ).float(), inv_freq)
    angles = torch.cat((angles, angles), -1)  # rotate_half pairs feature i with i + D/2
    return angles.cos().view(1, SEQ, 1, HEAD_DIM), angles.sin().view(1, SEQ, 1, HEAD_DIM)


def train(model, steps, data, cos, sin):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, target in data[:steps]:
        loss = F.mse_loss(model(x, cos, sin), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_fused_llama_block_trains_like_the_plain_block():
    torch.manual_seed(0)
    plain = Block(fused=False)
    fused = copy.deepcopy(plain)
    fused.fused = True
    plain, fused = plain.npu(), fused.npu()
    cos, sin = (t.npu() for t in rope_tables())
    data = [(torch.randn(BATCH, SEQ, DIM).npu(), torch.randn(BATCH, SEQ, DIM).npu()) for _ in range(5)]

    fused_losses = train(fused, 5, data, cos, sin)
    plain_losses = train(plain, 5, data, cos, sin)
    assert fused_losses[-1] < fused_losses[0]  # it trains
    torch.testing.assert_close(fused_losses, plain_losses, rtol=1e-4, atol=1e-5)
    for (name, p_fused), p_plain in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p_fused.detach().cpu(), p_plain.detach().cpu(), rtol=1e-4, atol=1e-5, msg=name)
