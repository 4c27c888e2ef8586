"""Train a small model with PyTorch Lightning's DDP strategy and deepreduce's hook.

    python examples/lightning_ddp.py                # every GPU of this machine
    python examples/lightning_ddp.py --devices 1    # one GPU (a world of one rank)

The hook is handed to Lightning as Lightning documents it for PowerSGD:
``DDPStrategy(ddp_comm_state=state, ddp_comm_hook=deepreduce_hook)``. The state is
built before Lightning creates the process group (``process_group=None``) and binds
the group at the hook's first call. Lightning registers communication hooks only
when its devices are CUDA ones, so this example needs a GPU; on a machine without
one it says so and stops. Lightning starts one process per device itself (no
torchrun needed); rank 0 prints the loss, the steps the hook compressed and the
bytes it sent.
"""

import argparse
import sys

import torch

import deepreduce as dr
import deepreduce.torch as drt

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
except ImportError:  # (the older package name)
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy


class Regression(pl.LightningModule):
    """An MLP that learns sin(a random linear function) of Gaussian inputs."""

    def __init__(self, state):
        super().__init__()
        self.state, self.before_last_step = state, None
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),
                                       torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                       torch.nn.Linear(512, 1))
        self.losses = []

    def on_train_batch_start(self, batch, batch_index):
        self.before_last_step = self.state.stats.snapshot()  # (kept for the last step)

    def training_step(self, batch, batch_index):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def dataset(samples: int) -> torch.utils.data.TensorDataset:
    """The same samples on every rank (Lightning's sampler gives each rank its share)."""
    generator = torch.Generator().manual_seed(0)
    target = torch.nn.Linear(64, 1)
    with torch.no_grad():
        target.weight.copy_(torch.randn(1, 64, generator=generator) / 8)
        x = torch.randn(samples, 64, generator=generator)
        return torch.utils.data.TensorDataset(x, torch.sin(target(x)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=None,
                        help="GPUs to train on (default: all of this machine's)")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("Lightning registers DDP communication hooks only on CUDA devices: this "
              "example needs a GPU (examples/torch_ddp.py runs on CPUs)", file=sys.stderr)
        return 2

    torch.manual_seed(0)  # (Lightning broadcasts rank 0's weights at the start anyway)
    # Built before any process group exists: it binds Lightning's at the first hook call.
    state = drt.DeepReduceState(process_group=None, sparsifier=dr.TopK(0.01), index="auto",
                                value="fp16", start_iter=10)
    trainer = pl.Trainer(accelerator="gpu", devices=args.devices or torch.cuda.device_count(),
                         strategy=DDPStrategy(ddp_comm_state=state,
                                              ddp_comm_hook=drt.deepreduce_hook),
                         max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    model = Regression(state)
    trainer.fit(model, torch.utils.data.DataLoader(dataset(64 * args.steps), batch_size=64,
                                                   shuffle=True))
    if trainer.global_rank == 0:
        last = state.stats.snapshot() - model.before_last_step  # every bucket of it
        print(f"loss {model.losses[0]:.4f} at the first step, {model.losses[-1]:.4f} at "
              f"step {len(model.losses)}", flush=True)
        print(f"deepreduce: {last.bytes_sent:,} bytes sent in the last step against "
              f"{last.dense_bytes:,} dense ({last.ratio:.1f}x fewer)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
