"""Expert parallelism against one process, float64: a MoE GPT (2 blocks, n_embd 32, 4 heads,
block 16, E = 4, top-1 and top-2, dropless and with a capacity factor) trained 3 AdamW steps
with ExpertParallel, each rank on its batch slice, against the same model in one process
over the global batch: the loss, the experts' load and every parameter (1e-10). With a
capacity factor the one-process model cuts the batch into one capacity group per rank, so it
drops exactly the tokens the ranks drop. At 2 ranks EP 2; at 4 ranks EP 4, and dp 4 x ep 2,
and under tensor parallelism dp 2 x tp 2 x ep 2 (MeshGPT: each MoE layer whole on its TP
ranks, the experts over EP groups of the DP ranks), the gathered model and its norm too.
Then the all-to-all bytes against the formula, the groups, and a checkpoint of the pieces
(get_state_dict / save at EP 2, load / set_state_dict in one process)."""

import numpy as np
import pytest

from minidp import comm, cross_entropy, nn, optim
from minidp.models.moe import expert_load, load_balancing_loss, moe_layers
from minidp.parallel import checkpoint
from minidp.parallel.experts import ExpertParallel, alltoall_bytes, expert_groups
from minidp.parallel.mesh import Mesh
from minidp.parallel.tensor_parallel.mesh_gpt import MeshGPT

F64 = np.float64
STEPS, PER_RANK = 3, 2


def config(top_k, capacity_factor, **more):
    sizes = dict(vocab_size=16, block_size=16, n_layer=2, n_head=4, n_embd=32, n_experts=4)
    return nn.GPTConfig(**{**sizes, "top_k": top_k, "capacity_factor": capacity_factor, **more})


def batches(ranks):
    """STEPS global batches of PER_RANK * ranks sequences: (inputs, targets) each."""
    tokens = np.random.default_rng(0).integers(0, 16, (STEPS, PER_RANK * ranks, 17))
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def one_process(cfg, ranks):
    """Losses, loads and final parameters of the model trained on the global batches."""
    model = nn.GPT(cfg, seed=1, dtype=F64)
    for _, layer in moe_layers(model):
        layer.capacity_groups = ranks  # rank r's slice: its own capacity, as on rank r
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    losses, loads = [], []
    for x, y in batches(ranks):
        opt.zero_grad()
        loss = cross_entropy(model(x), y) + load_balancing_loss(model)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        loads.append(expert_load(model))
    return losses, loads, dict(model.named_parameters())


def check_expert_parallel(ep, top_k, capacity_factor):
    world = comm.world()
    cfg = config(top_k, capacity_factor)
    want_losses, want_loads, want = one_process(cfg, world.size)
    model = ExpertParallel(nn.GPT(cfg, seed=1, dtype=F64), world, ep=ep)
    assert all(len(layer.experts) == 4 // ep for _, layer in model.layers)
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    mine = slice(world.rank * PER_RANK, (world.rank + 1) * PER_RANK)
    case = f"ep {ep} of {world.size}, top-{top_k}, capacity factor {capacity_factor}"
    for step, (x, y) in enumerate(batches(world.size)):
        opt.zero_grad()
        loss = cross_entropy(model(x[mine]), y[mine]) + load_balancing_loss(model.module)
        loss.backward()
        model.finish_gradient_sync()
        opt.step()
        mean = comm.allreduce(np.array([loss.item()]), op="avg", group=world)[0]
        np.testing.assert_allclose(mean, want_losses[step], rtol=1e-10, err_msg=case)
        assert expert_load(model.module) == want_loads[step], case
    if capacity_factor:
        assert sum(load["dropped"] for load in want_loads) > 0, case  # the case drops some
    got = model.full_state_dict()
    assert got.keys() == want.keys()
    for name, p in want.items():
        np.testing.assert_allclose(got[name], p.data, rtol=1e-10, atol=1e-13, err_msg=name)


@pytest.mark.parallel(nprocs=[2, 4])
@pytest.mark.timeout(120)
def test_expert_parallel_equals_one_process_over_the_global_batch():
    for ep in {2: (2,), 4: (4, 2)}[comm.world().size]:
        for top_k in (1, 2):
            for capacity_factor in (0.0, 1.0):
                check_expert_parallel(ep, top_k, capacity_factor)


@pytest.mark.parallel(nprocs=[4])
@pytest.mark.timeout(120)
def test_experts_over_dp_with_the_moe_whole_on_each_tp_rank_equal_one_process():
    """dp 2 x tp 2 x ep 2: attention split over TP, the MoE layers replicated over TP, their
    experts spread over the DP ranks at one TP coordinate; each DP coordinate one capacity
    group, as one process with 2 capacity groups."""
    mesh = Mesh(dp=2, tp=2)
    d = mesh.coords["dp"]
    mine = slice(d * PER_RANK, (d + 1) * PER_RANK)
    for top_k, capacity_factor in ((1, 0.0), (2, 1.0)):
        cfg = config(top_k, capacity_factor)
        want_losses, want_loads, want = one_process(cfg, mesh.dp)
        gpt = nn.GPT(cfg, seed=1, dtype=F64)
        net = MeshGPT(gpt, mesh, ep=2)
        assert [len(layer.experts) for _, layer in net.experts.layers] == [2, 2]
        opt = optim.AdamW(net.model.parameters(), lr=1e-2)
        case = f"dp 2 x tp 2 x ep 2, top-{top_k}, capacity factor {capacity_factor}"
        for step, (x, y) in enumerate(batches(mesh.dp)):
            opt.zero_grad()
            loss = net.loss(x[mine], y[mine]) + load_balancing_loss(net.model)
            loss.backward()
            net.experts.finish_gradient_sync()  # experts over expert-DP, the rest over DP
            net.after_dp_sync(take_rank0=False)  # the replicated ones alike over TP
            opt.step()
            mean = comm.allreduce(np.array([loss.item()]), op="avg", group=mesh.dp_group)[0]
            np.testing.assert_allclose(mean, want_losses[step], rtol=1e-10, err_msg=case)
            assert expert_load(net.model) == want_loads[step], case
        squares = sum(float(np.vdot(p.data, p.data)) for p in want.values())
        assert net.norm("data") == pytest.approx(np.sqrt(squares), rel=1e-10)
        net.gather_into(gpt)
        for name, p in gpt.named_parameters():
            np.testing.assert_allclose(
                p.data, want[name].data, rtol=1e-10, atol=1e-13, err_msg=name
            )
        net.experts.close()
    mesh.close()


@pytest.mark.parallel(nprocs=[4])
@pytest.mark.timeout(60)
def test_the_groups_and_the_bytes_of_each_all_to_all():
    world = comm.world()
    ep_group, expert_dp = expert_groups(world, 2)
    block = 2 * (world.rank // 2)
    assert ep_group.world_ranks == (block, block + 1)
    assert expert_dp.world_ranks == (world.rank % 2, world.rank % 2 + 2)

    with pytest.raises(ValueError, match="do not divide by ep=2"):
        ExpertParallel(nn.GPT(config(1, 0.0, n_experts=3), seed=1), world, ep=2)
    for ep in (2, 4):
        cfg = config(2, 0.0, moe_every=2, n_layer=3)  # MoE in block 1 only
        model = ExpertParallel(nn.GPT(cfg, seed=1, dtype=F64), world, ep=ep)
        x, y = batches(world.size)[0]
        mine = slice(world.rank * PER_RANK, (world.rank + 1) * PER_RANK)
        model.ep_group.reset_counters()
        loss = cross_entropy(model(x[mine]), y[mine]) + load_balancing_loss(model.module)
        loss.backward()
        (_, layer), *others = model.layers
        assert not others
        sent = model.ep_group.counters["alltoall"]
        # four a layer: dispatch and combine forward, their reverses backward
        assert sent["calls"] == 4
        assert sent["bytes_sent"] == 4 * alltoall_bytes(ep, 4, layer.load.slots, 32, 8)
        assert sent["bytes_recv"] == sent["bytes_sent"]  # every row as large as every other


def test_ep_must_divide_the_data_parallel_ranks_and_the_experts():
    world = comm.world()
    with pytest.raises(ValueError, match="divisor"):
        expert_groups(world, world.size + 1)
    with pytest.raises(ValueError, match="no MoE layer"):
        ExpertParallel(nn.GPT(config(1, 0.0, n_experts=0), seed=1), world)


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_a_checkpoint_at_ep_2_loads_into_one_process(tmp_path_factory):
    """get_state_dict / save at EP 2 on 2 ranks, after 2 of 3 steps; load / set_state_dict
    in one process (each expert read from the shard of the rank that saved it): the last
    step ends where the one process's 3 steps end (1e-10)."""
    world, cfg = comm.world(), config(2, 0.0)
    want = one_process(cfg, world.size)[2]
    path = (str(tmp_path_factory.mktemp("ep")) if world.rank == 0 else "") + "/step_2"
    path = comm.broadcast_text(path, root=0, group=world)
    model = ExpertParallel(nn.GPT(cfg, seed=1, dtype=F64), world, ep=2)
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    mine = slice(world.rank * PER_RANK, (world.rank + 1) * PER_RANK)
    for x, y in batches(world.size)[:2]:
        opt.zero_grad()
        (cross_entropy(model(x[mine]), y[mine]) + load_balancing_loss(model.module)).backward()
        model.finish_gradient_sync()
        opt.step()
    model_sd, optim_sd = checkpoint.get_state_dict(model, opt)
    assert ("blocks.0.moe.experts.3.fc.weight" in model_sd) == (world.rank == 1)  # its own
    checkpoint.save({"model": model_sd, "optim": optim_sd}, path, world, step=2)
    model.close()
    alone = world.split(0 if world.rank == 0 else None)
    if alone is None:
        return
    net = nn.GPT(cfg, seed=7, dtype=F64)  # other weights: every one must load
    for _, layer in moe_layers(net):
        layer.capacity_groups = world.size
    opt = optim.AdamW(net.parameters(), lr=1e-2)
    model_sd, optim_sd = checkpoint.get_state_dict(net, opt)
    state = {"model": model_sd, "optim": optim_sd}
    checkpoint.load(state, path, alone)
    checkpoint.set_state_dict(net, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    x, y = batches(world.size)[2]
    opt.zero_grad()
    (cross_entropy(net(x), y) + load_balancing_loss(net)).backward()
    opt.step()
    for name, p in net.named_parameters():
        np.testing.assert_allclose(p.data, want[name].data, rtol=1e-10, atol=1e-13, err_msg=name)
