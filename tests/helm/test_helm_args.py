"""Every command line the chart gives a container is one that pdserve's own parser accepts.

Each container runs `pdserve <role> ARGS`; ARGS are parsed by the role's own parser
(`<package>.__main__.build_parser()`, which `pdserve <role>` runs) and turned into the role's
frozen config, so flag values are checked too.
$(VAR) references are expanded as the kubelet does, from the container's own env.
"""

from __future__ import annotations

import pytest

from tests.support import helm_tools as ht

pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (test extra)")


def _command_lines(toggle: str) -> list[tuple[str, dict, list[str]]]:
    lines = []
    for deployment in ht.of_kind(ht.toggle_manifests(toggle), "Deployment"):
        for container in ht.containers(deployment):
            lines.append((ht.component(deployment), container, container["args"]))
    return lines


@pytest.mark.parametrize("toggle", ht.TOGGLES)
def test_every_container_command_line_parses_into_a_valid_config(toggle: str) -> None:
    seen = set()
    for role, container, args in _command_lines(toggle):
        assert container["command"] == ["pdserve"]
        assert args[0] == role, f"{role} container runs `pdserve {args[0]}`"
        parser = ht.role_parser(role)
        argv = ht.expand_env_refs(args[1:], ht.env_of(container))
        try:
            ns = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"pdserve {role} rejects the args {argv}")
        ht.role_config(role, ns)  # raises ConfigError on a bad value
        seen.add(role)
    assert seen == set(ht.ROLES)


def _parsed(toggle: str, role: str):
    [(_, container, args)] = [line for line in _command_lines(toggle) if line[0] == role]
    parser = ht.role_parser(role)
    return parser.parse_args(ht.expand_env_refs(args[1:], ht.env_of(container))), container


def test_nodes_advertise_their_pod_ip_on_fixed_ports_and_find_the_registry() -> None:
    for role in ht.NODE_ROLES:
        ns, container = _parsed("default", role)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ns.advertise_host == "10.1.2.3"  # $(POD_IP)
        assert (
            ht.env_of(container)["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        )
        assert (
            ht.env_of(container)["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
            == "metadata.name"
        )
        assert ns.host == "0.0.0.0"
        assert (ns.port, ns.request_port, ns.control_port) == (
            ports["http"],
            ports["request"],
            ports["control"],
        )
        assert 0 not in (ns.request_port, ns.control_port)
        assert ns.bootstrap_urls == [f"http://{ht.role_name('bootstrap')}-registry:8998"]
        assert ns.node_id.startswith(ht.RELEASE)  # $(POD_NAME): unique per pod


def test_bootstrap_listens_on_its_container_ports() -> None:
    ns, container = _parsed("default", "bootstrap")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ns.host, ns.port, ns.bootstrap_port) == ("0.0.0.0", ports["http"], ports["registry"])
    # Nodes send tokens to the gateway's reply socket at the pod IP, on a port the
    # NetworkPolicy names.
    assert (ns.advertise_host, ns.reply_port) == ("10.1.2.3", ports["reply"])
    ns, _ = _parsed("restricted-api", "bootstrap")
    assert ns.lease_s == 15


def test_the_lease_is_one_value_for_the_registry_and_every_node() -> None:
    """--lease-timeout is the cluster's one lease: the registry's and the KV rooms'."""
    for role in ("bootstrap", "prefill", "decode"):
        ns, _ = _parsed("restricted-api", role)
        assert ns.lease_s == 15, role
        ns, _ = _parsed("default", role)
        assert ns.lease_s == 10.0, role  # unset: pdserve's default everywhere


def test_every_pod_gets_the_cluster_token_from_the_secret() -> None:
    for toggle, name, key in (
        ("default", "demo-pdserve-auth", "token"),
        ("existing-secret", "pdserve-token", "cluster"),
    ):
        for _, container, _ in _command_lines(toggle):
            ref = ht.env_of(container)["PDSERVE_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"]) == (name, key)
            assert "--auth-token" not in container["args"]  # never on a command line


def test_api_keys_come_from_their_own_secret_as_a_file_that_rotates() -> None:
    ns, container = _parsed("default", "bootstrap")
    assert ns.api_key_file is None and not ns.api_keys  # an open API by default
    ns, container = _parsed("api-keys", "bootstrap")
    assert ns.api_key_file == "/etc/pdserve/api-keys/keys"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "api-keys")
    assert mount == {"name": "api-keys", "mountPath": "/etc/pdserve/api-keys", "readOnly": True}
    docs = ht.toggle_manifests("api-keys")
    pod = ht.named(docs, "Deployment", ht.role_name("bootstrap"))["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    assert volume["secret"] == {"secretName": "client-keys"}  # not the cluster token's Secret
    for role in ht.NODE_ROLES:  # nodes never see the API keys
        _, node = _parsed("api-keys", role)
        assert all(m["name"] != "api-keys" for m in node.get("volumeMounts", []))


def test_the_model_comes_from_the_image_or_a_read_only_mount_never_a_hub() -> None:
    for role in ht.ROLES:
        ns, container = _parsed("default", role)
        assert ns.model_path is None  # the built-in model shipped in the image
        assert ht.env_of(container)["HF_HUB_OFFLINE"]["value"] == "1"
    docs = ht.toggle_manifests("model-pvc")
    for role in ht.ROLES:
        ns, container = _parsed("model-pvc", role)
        assert ns.model_path == "/models/llama-3-8b"
        mount = next(m for m in container["volumeMounts"] if m["name"] == "model")
        assert mount["mountPath"] == "/models" and mount["readOnly"] is True
        pod = ht.named(docs, "Deployment", ht.role_name(role))["spec"]["template"]["spec"]
        volume = next(v for v in pod["volumes"] if v["name"] == "model")
        assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    ns, _ = _parsed("model-hostpath", "prefill")
    assert ns.model_path == "/models/smol.gguf"


def test_gpu_values_request_the_devices_and_run_on_cuda() -> None:
    for role in ht.NODE_ROLES:
        ns, container = _parsed("gpu", role)
        assert ns.device == "cuda"
        for kind in ("requests", "limits"):
            assert container["resources"][kind]["nvidia.com/gpu"] == 1
            assert container["resources"][kind]["rdma/rdma_shared_device_a"] == 1
        tls = ht.env_of(container)["UCX_TLS"]["value"].split(",")
        assert {"rc", "tcp", "cuda_copy", "cuda_ipc"} <= set(tls)
        assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
        assert container["image"] == "pdserve:0.1.0-cuda"
        ns, container = _parsed("default", role)
        assert ns.device == "cpu" and "UCX_TLS" not in ht.env_of(container)
        assert not any("nvidia.com/gpu" in r for r in container["resources"].values())


def test_gpu_is_per_role_and_needs_no_rdma_for_its_cuda_transports() -> None:
    # Only prefill on a GPU, no RDMA: prefill gets the GPU, --device cuda and UCX's CUDA
    # transports over the default list; decode stays a CPU pod with pdserve's own default.
    docs = ht.manifests({"prefill": {"gpu": {"enabled": True}}})
    for role in ht.NODE_ROLES:
        [container] = ht.containers(ht.named(docs, "Deployment", ht.role_name(role)))
        args = ht.expand_env_refs(container["args"][1:], ht.env_of(container))
        ns = ht.role_parser(role).parse_args(args)
        env = ht.env_of(container)
        has_gpu = {
            kind: "nvidia.com/gpu" in container["resources"].get(kind, {})
            for kind in ("requests", "limits")
        }
        if role == "prefill":
            assert ns.device == "cuda"
            assert has_gpu == {"requests": True, "limits": True}
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
            assert env["UCX_TLS"]["value"] == "tcp,self,sm,cuda_copy,cuda_ipc"
        else:
            assert ns.device == "cpu"
            assert has_gpu == {"requests": False, "limits": False}
            assert "UCX_TLS" not in env


def test_extra_args_reach_their_role() -> None:
    ns, _ = _parsed("extra-args", "prefill")
    assert (ns.schedule_policy, ns.max_total_tokens, ns.log_level) == ("lpm", 65536, "DEBUG")
    ns, _ = _parsed("extra-args", "decode")
    assert (ns.retraction_policy, ns.num_reserved_decode_tokens) == ("length", 256)
    ns, _ = _parsed("extra-args", "bootstrap")
    assert ns.max_queued_requests == 512


def test_the_grace_period_covers_prestop_and_the_node_drain() -> None:
    for role in ht.NODE_ROLES:
        pod = ht.named(ht.toggle_manifests("default"), "Deployment", ht.role_name(role))["spec"][
            "template"
        ]["spec"]
        [container] = pod["containers"]
        args = container["args"]
        drain_s = float(args[args.index("--drain-timeout") + 1])  # the node's own flag
        assert drain_s == 30
        sleep = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
        assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
        assert pod["terminationGracePeriodSeconds"] >= sleep + drain_s + 5


def test_cpu_nodes_keep_their_kernel_choice_in_a_writable_pod_volume() -> None:
    """The root filesystem is read-only: a CPU node's kernel choice goes to an emptyDir,
    which outlives a container restart (the restart then skips warm-up's measuring)."""
    docs = ht.toggle_manifests("default")
    for role in ht.NODE_ROLES:
        ns, container = _parsed("default", role)
        assert ns.kernel_cache_dir == "/var/cache/pdserve"
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        mount = next(m for m in container["volumeMounts"] if m["name"] == "kernel-cache")
        assert mount["mountPath"] == ns.kernel_cache_dir and not mount.get("readOnly")
        pod = ht.named(docs, "Deployment", ht.role_name(role))["spec"]["template"]["spec"]
        volume = next(v for v in pod["volumes"] if v["name"] == "kernel-cache")
        assert "emptyDir" in volume
        ns, container = _parsed("gpu", role)  # GPU nodes choose no CPU kernels
        assert "/var/cache/pdserve" not in ns.kernel_cache_dir
        assert all(m["name"] != "kernel-cache" for m in container["volumeMounts"])
