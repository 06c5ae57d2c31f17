"""apex.optimizers.FusedAdam's update written out: Adam with bias correction; adam_w_mode=True
decays the weights decoupled (p -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)), False adds
weight_decay * p to the gradient (L2). FusedSGD's: the decay added to the gradient, the momentum buffer
starting at the first step's gradient, Nesterov's look-ahead."""

import torch


class FusedAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True, capturable=False, master_weights=False):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                                      weight_decay=weight_decay))
        self.adam_w_mode = adam_w_mode

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                grad = p.grad if self.adam_w_mode else p.grad + group["weight_decay"] * p
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                m_hat = state["exp_avg"] / (1 - beta1 ** state["step"])
                v_hat = state["exp_avg_sq"] / (1 - beta2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if self.adam_w_mode:
                    update = update + group["weight_decay"] * p
                p.sub_(group["lr"] * update)


class FusedSGD(torch.optim.Optimizer):
    def __init__(self, params, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                 wd_after_momentum=False, materialize_master_grads=True, set_grad_none=False):
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                step = p.grad + group["weight_decay"] * p
                if group["momentum"]:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = step.clone()
                    else:
                        state["momentum_buffer"].mul_(group["momentum"]).add_(step, alpha=1 - group["dampening"])
                    buffer = state["momentum_buffer"]
                    step = step + group["momentum"] * buffer if group["nesterov"] else buffer
                p.sub_(group["lr"] * step)
