"""``geofm bench fed-round``: a federated round's server cost against the number of clients, client
overhead beyond local training, and the bytes each round puts on the wire.

Server, for each M in ``clients`` (the M values alternate from round to round): decoding and
screening the M uploads and averaging them (:meth:`~geofm.fl.algorithms.FedAvg.screen`),
K-means of the clients (:func:`~geofm.fl.aggregation.clustering.cluster_clients`), similarity
distillation of the global model on public images (timed on its own) and the downlink's encoding,
all as :meth:`~geofm.fl.algorithms.FedSense.server_update` runs them; a least-squares line
through the per-M medians gives the cost per client. The uploads are real 1-bit packets of random
updates of the config's model size.

Client, per round, each piece of the round as the federated client runs it
(:class:`~geofm.fl.client_round.ClientRound`): receiving (a fresh model, the downlink decoded
into it), the engine with the algorithm's hooks, the upload (error feedback + codec) and, per
micro-step, the drift-aware perturbation, set against one local training step of the config's model
under every hook of the algorithm.

Traffic: bytes per round up and down for FedSense as configured, with the downlink quantised at
1-8 bits, and for FedAvg in float32.

Flat server (:mod:`benchmarks.fed_flat`): the server's peak memory and seconds per round at 10 and
40 clients of a Swin-B, FedAvg fp32 and FedSense 1-bit, against the target of a peak at 40 within
1.3x of the peak at 10. ``parts=[flat]`` runs these rows alone.
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import Report, Target, fit_line, repo_path, summary

DEFAULTS: dict[str, Any] = {
    "config": "configs/federated/fedsense_swin_tiny__10clients__100rounds__1bit_ef.yaml",
    "overrides": [],
    "clients": [2, 4, 8, 16],
    "rounds": 3,
    "distill_steps": 2,  # None: the config's (10 in the paper's setting; minutes per round on a CPU)
    "distill_batch_size": 16,  # None: the config's
    "micro_batch": 4,
    "downlink_bits": [1, 2, 4, 8],
    "parts": ["scaling", "flat"],  # scaling: the rows above; flat: the flat-server rows (benchmarks/fed_flat.py)
    "flat_config": "configs/pretrain/gfm_swin_base__img192_win6__100ep.yaml",
    "flat_clients": [10, 40],
}
QUICK: dict[str, Any] = {
    "config": "configs/federated/demo_fedsense_swin_micro__3inst__1bit_ef.yaml",
    "clients": [2, 4],
    "rounds": 1,
    "distill_steps": 1,
    "distill_batch_size": 4,
    "flat_config": "configs/pretrain/demo_gfm_swin_micro__img64_win4__4band.yaml",
    "flat_clients": [2, 8],
}


def _config(settings: dict[str, Any], folder: Path):
    """The federated config with the benchmark's overrides and, with a teacher, random teacher weights."""
    from geofm.config.federated import FederatedConfig
    from geofm.models.backbones import backbone_kwargs, create_backbone
    from geofm.tasks.mim.task import mim_options, with_teacher_checkpoint

    overrides = [*settings["overrides"], f"train.micro_batch_size={settings['micro_batch']}"]
    if settings["distill_steps"] is not None:
        overrides.append(f"algorithm.options.distill_steps={settings['distill_steps']}")
    if settings["distill_batch_size"] is not None:
        overrides.append(f"algorithm.options.distill_batch_size={settings['distill_batch_size']}")
    cfg = FederatedConfig.from_file(repo_path(settings["config"]), overrides)
    t = mim_options(cfg).teacher
    if t is not None:
        weights = folder / "teacher.pth"
        kwargs = backbone_kwargs(in_chans=3, img_size=t.img_size, window_size=t.window_size, timm_kwargs=t.timm_kwargs)
        torch.save(create_backbone(t.arch, kwargs).state_dict(), weights)
        cfg = with_teacher_checkpoint(cfg, weights)
    return cfg


class Server:
    """The server's per-round work for M clients, timed piece by piece (as FederatedServer.aggregate runs it).

    The algorithm is attached to a context whose public images are one random batch, repeated: its
    similarity distillation (FedSense with ``distill_steps``) runs as the server's does, timed apart.
    """

    def __init__(self, cfg, algorithm, model, layout, uploads) -> None:
        from geofm.fl.algorithms.context import PublicImages, ServerContext
        from geofm.memory import keep_freed_memory
        from geofm.tasks.pretraining import pooled_features

        keep_freed_memory()  # as FederatedServer does

        self.algorithm, self.uploads = algorithm, uploads
        self.global_model = layout.flatten_module(model)
        size = cfg.model.img_size
        public = torch.randn(
            algorithm.options.distill_batch_size,
            len(cfg.data.bands),
            size,
            size,
            generator=torch.Generator().manual_seed(3),
        )
        images = PublicImages(
            lambda rnd, batch_size: itertools.repeat(public), pooled_features, lambda m: m.encoder.parameters()
        )
        algorithm.attach(ServerContext(model, layout, images))
        self.distill_s = 0.0
        distillation = getattr(algorithm, "distillation", None)
        if distillation is not None:

            def timed(*args):
                started = time.perf_counter()
                outcome = distillation(*args)
                self.distill_s += time.perf_counter() - started
                return outcome

            algorithm.distillation = timed

    def __call__(self, m: int) -> dict[str, float]:
        self.distill_s = 0.0
        started = time.perf_counter()
        payloads = self.algorithm.aggregate(self.uploads[:m])
        screened = time.perf_counter()
        self.algorithm.server_update(self.global_model, payloads)
        updated = time.perf_counter()
        self.algorithm.send(self.global_model, 1, [u.client for u in self.uploads[:m]], torch.Generator())
        done = time.perf_counter()
        return {
            "decode_screen_average": screened - started,
            "cluster": updated - screened - self.distill_s,
            "similarity_distillation": self.distill_s,
            "downlink": done - updated,
            "total": done - started,
        }


def run(settings: dict[str, Any]) -> Report:
    """The parts of ``settings["parts"]``: the scaling rows (server, client, traffic), the flat-server rows."""
    from benchmarks.fed_flat import run_flat

    report = _scaling(settings) if "scaling" in settings["parts"] else Report({})
    if "flat" in settings["parts"]:
        results, rows, targets, notes = run_flat(settings)
        report.results["flat_server"] = results
        report.rows += rows
        report.targets += targets
        report.notes += notes
    return report


def _scaling(settings: dict[str, Any]) -> Report:
    from geofm.fl.aggregation.uploads import ClientUpload
    from geofm.fl.algorithms import build_algorithm
    from geofm.fl.algorithms.rounds import LocalUpdate, payload_arrays
    from geofm.fl.client_round import ClientRound
    from geofm.fl.communication.codec import Codec
    from geofm.fl.parameter_vectors import ParameterLayout
    from geofm.tasks import federated_task
    from geofm.tasks.mim.masking import MaskGenerator
    from geofm.tasks.mim.task import build_student, mim_options

    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(settings, Path(tmp))
        torch.manual_seed(0)
        model = build_student(cfg)
        layout = ParameterLayout.of(model)
        n = layout.numel
        algorithm = build_algorithm(cfg.algorithm, layout)
        generator = torch.Generator().manual_seed(1)
        uploads = []
        for i in range(max(settings["clients"])):
            delta = torch.randn(n, generator=generator) * 1e-3 * (1 + i % 3)
            arrays, _ = algorithm.upload(LocalUpdate({"update": delta}), {}, generator)
            uploads.append(ClientUpload(f"client{i}", payload_arrays(arrays), 100 + i))
        server = Server(cfg, algorithm, model, layout, uploads)

        # Server: the M values alternate, round after round.
        per_m: dict[int, list[dict[str, float]]] = {m: [] for m in settings["clients"]}
        server(min(settings["clients"]))  # warm-up
        for r in range(settings["rounds"]):
            order = settings["clients"] if r % 2 == 0 else list(reversed(settings["clients"]))
            for m in order:
                per_m[m].append(server(m))

        # Client: a round's pieces as the federated client runs them (ClientRound), one local step included.
        task = federated_task(cfg)
        sent, how = algorithm.send(layout.flatten_module(model), 1, ["client0"], torch.Generator())["client0"]
        config = {"round": 1, "lr": 1e-4, **how}
        b, c, s = cfg.train.micro_batch_size, len(cfg.data.bands), cfg.model.img_size
        masking = mim_options(cfg).masking
        masks = MaskGenerator(s, masking.mask_patch_size, model.patch_size, masking.mask_ratio)
        batch = {
            "image": torch.randn(b, c, s, s),
            "mask": torch.stack([masks() for _ in range(b)]),
            "valid": torch.ones(b, c, s, s, dtype=torch.bool),
        }
        rounds: list[ClientRound] = []

        def receive() -> None:
            rounds.append(ClientRound(task, cfg, "client0", 1, 1e-4))
            rounds[-1].receive(sent, config, {})

        def engine() -> None:
            rounds[-1].build_engine()

        def local_step() -> None:
            rounds[-1].loop.step(0, [batch])

        def perturbation() -> None:
            with rounds[-1].hooks.around_gradient():
                pass

        def upload() -> None:
            rounds.pop().finish({}, 1)

        client_calls = {
            "receive": receive,
            "engine": engine,
            "local_step": local_step,
            "perturbation": perturbation,
            "upload": upload,
        }
        for call in client_calls.values():
            call()
        client: dict[str, list[float]] = {k: [] for k in client_calls}
        for _ in range(max(3, settings["rounds"])):
            for name, call in client_calls.items():
                started = time.perf_counter()
                call()
                client[name].append(time.perf_counter() - started)

    # Server figures and the line through them.
    parts = ("decode_screen_average", "cluster", "similarity_distillation", "downlink", "total")
    medians = {m: {k: statistics.median(r[k] for r in runs) for k in parts} for m, runs in per_m.items()}
    ms = list(medians)
    lines = {k: fit_line(ms, [medians[m][k] for m in ms]) for k in parts}
    without_distill = fit_line(ms, [medians[m]["total"] - medians[m]["similarity_distillation"] for m in ms])

    # Traffic per round.
    model_bytes = Codec(bits=32).packet_nbytes(n)
    up_bytes = algorithm.feedback["update"].codec.packet_nbytes(n)
    traffic = {}
    for m in ms:
        fedavg = 2 * m * model_bytes
        entry = {"fedavg_fp32": fedavg, "fedsense_model_down": m * (up_bytes + model_bytes)}
        for bits in settings["downlink_bits"]:
            down = Codec(bits=bits, bucket_size=cfg.algorithm.downlink.bucket_size).packet_nbytes(n)
            entry[f"fedsense_down_{bits}bit"] = m * (up_bytes + down)
        entry["fedavg_over_best"] = fedavg / min(v for k, v in entry.items() if k.startswith("fedsense_down"))
        traffic[m] = entry

    step = summary(client["local_step"])["median"]
    client_summary = {k: summary(v) for k, v in client.items()}
    micro_steps = cfg.train.grad_accum_steps
    options = algorithm.options  # FedSense's (the benchmark's configs are FedSense runs)
    results = {
        "model_values": n,
        "clusters": options.clusters,
        "distill_steps": options.distill_steps,
        "distill_batch_size": options.distill_batch_size,
        "server_s_by_clients": medians,
        "server_fit": lines,
        "server_fit_without_distillation": without_distill,
        "client_s": client_summary,
        "client_perturbation_share_of_step": client_summary["perturbation"]["median"] / step,
        "bytes_per_round": traffic,
    }
    rows = [
        {
            "clients": m,
            **{k + " s": v for k, v in medians[m].items()},
            "bytes fp32 FedAvg": traffic[m]["fedavg_fp32"],
            "bytes best": min(v for k, v in traffic[m].items() if k.startswith("fedsense_down")),
        }
        for m in ms
    ]
    rows.append({"clients": "slope s/client", **{k + " s": lines[k]["slope"] for k in parts}})
    targets = [
        Target("server cost linear in M (r2 of the fit, without distillation)", without_distill["r2"], ">=", 0.9)
    ]
    for bits in settings["downlink_bits"]:
        ratio = traffic[ms[-1]]["fedavg_fp32"] / traffic[ms[-1]][f"fedsense_down_{bits}bit"]
        targets.append(Target(f"FedAvg fp32 / FedSense round bytes, downlink at {bits} bit", ratio, ">=", 10.0, "x"))
    notes = [
        f"model of {n:,} values; server slope {without_distill['slope'] * 1e3:.1f} ms per client without the similarity "
        f"distillation ({medians[ms[-1]]['similarity_distillation']:.2f} s at {options.distill_steps} steps of "
        f"{options.distill_batch_size} images, {options.clusters or 'one per client'} groups)",
        f"client per round: receive (model built, downlink decoded into it) {client_summary['receive']['median']:.3f} s, "
        f"engine and hooks {client_summary['engine']['median']:.3f} s, upload {client_summary['upload']['median']:.3f} s; "
        f"per micro-step: perturbation "
        f"{client_summary['perturbation']['median'] * 1e3:.1f} ms against a {step:.3f} s local step ({micro_steps} micro-step(s) per step)",
        "bytes per round for FedSense: uploads + downlink quantised at each bit width (steady state; a client's first round gets the whole model)",
    ]
    return Report(results, targets, rows, notes)
