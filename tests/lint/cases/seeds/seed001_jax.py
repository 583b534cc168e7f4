# Seed 001: the JAX versions (jmp policy and loss scale). Not torch at all: must lint clean.
import jax
import jax.numpy as jnp
import jmp
import optax

policy = jmp.get_policy("params=float32,compute=bfloat16,output=float32")


def forward(params, x):
    params, x = policy.cast_to_compute((params, x))
    h = jax.nn.relu(x @ params["w1"])
    return policy.cast_to_output(h @ params["w2"])


def loss_fn(params, x, y):
    return jnp.mean((forward(params, x) - y) ** 2)  # reduction in fp32


opt = optax.adamw(3e-4)
loss_scale = jmp.DynamicLossScale(jnp.float32(2 ** 15))


def train_step(params, opt_state, loss_scale, x, y):
    def scaled_loss(p):
        return loss_scale.scale(loss_fn(p, x, y))

    grads = jax.grad(scaled_loss)(params)
    grads = loss_scale.unscale(grads)

    finite = jmp.all_finite(grads)  # the inf/NaN check
    loss_scale = loss_scale.adjust(finite)  # halve or grow the scale
    updates, new_opt_state = opt.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    # Commit the step only if grads were finite, else keep the old trees.
    params, opt_state = jmp.select_tree(finite, (new_params, new_opt_state), (params, opt_state))
    return params, opt_state, loss_scale
