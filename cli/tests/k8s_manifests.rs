//! The TOML configs inside the committed Kubernetes renderings (k8s/base, k8s/examples — kept
//! equal to what the Helm chart renders by scripts/k8s-check.sh) parse with the real config
//! types, whose `deny_unknown_fields` would make the processes refuse to start on a bad field.

use std::path::{Path, PathBuf};

use strata_master::MasterConfig;
use strata_worker::WorkerConfig;

fn k8s(rel: &str) -> String {
    let path: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR")).join("../k8s").join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The `KEY.toml: |` block scalars of the ConfigMaps in a rendered file, as (key, text).
fn toml_blocks(yaml: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut lines = yaml.lines().peekable();
    while let Some(line) = lines.next() {
        let Some(key) = line.strip_prefix("  ").and_then(|l| l.strip_suffix(": |")) else { continue };
        if !key.ends_with(".toml") || key.starts_with(' ') {
            continue;
        }
        let mut text = String::new();
        while let Some(next) = lines.peek() {
            if !next.is_empty() && !next.starts_with("    ") {
                break;
            }
            text.push_str(next.get(4..).unwrap_or(""));
            text.push('\n');
            lines.next();
        }
        out.push((key.to_string(), text));
    }
    out
}

fn block<'a>(blocks: &'a [(String, String)], key: &str) -> &'a str {
    &blocks.iter().find(|(k, _)| k == key).unwrap_or_else(|| panic!("no {key} in the rendering")).1
}

#[test]
fn rendered_master_and_worker_configs_parse_with_the_real_types() {
    let blocks = toml_blocks(&k8s("base/strata.yaml"));
    assert_eq!(blocks.len(), 2, "expected master.toml and worker.toml: {blocks:?}");

    let master: MasterConfig = toml::from_str(block(&blocks, "master.toml")).expect("master.toml parses");
    assert_eq!(master.rpc_addr, "0.0.0.0:19998".parse().unwrap());
    assert_eq!(master.http_addr, "0.0.0.0:19999".parse().unwrap());
    assert_eq!(master.data_dir, PathBuf::from("/var/lib/strata/master"));

    let worker: WorkerConfig = toml::from_str(block(&blocks, "worker.toml")).expect("worker.toml parses");
    assert_eq!(worker.master_addr, "strata-master:19998");
    assert_eq!(worker.data_addr, "0.0.0.0:29998".parse().unwrap());
    // The cluster preset: a 16 GiB DRAM tier and a 500 GiB NVMe tier.
    assert_eq!(worker.memory_capacity, 16 << 30);
    assert_eq!(worker.nvme_capacity, 500 << 30);
    assert!(!worker.sidecar);
}

#[test]
fn rendered_sidecar_config_parses_and_matches_the_trainers_socket() {
    let yaml = k8s("examples/sidecar-job.yaml");
    let blocks = toml_blocks(&yaml);
    let sidecar: WorkerConfig = toml::from_str(block(&blocks, "sidecar.toml")).expect("sidecar.toml parses");
    assert!(sidecar.sidecar);
    assert_eq!(sidecar.nvme_capacity, 0);
    assert_eq!(sidecar.memory_capacity, 2 << 30);
    let socket = sidecar.socket_path.expect("socket_path is set");
    // The trainer container must look for the socket where the sidecar serves it.
    let env = yaml
        .lines()
        .skip_while(|l| !l.contains("- name: STRATA_SIDECAR_SOCKET"))
        .nth(1)
        .and_then(|l| l.trim().strip_prefix("value: "))
        .expect("the trainer has STRATA_SIDECAR_SOCKET");
    assert_eq!(env.trim_matches('"'), socket.to_str().unwrap());
    // The socket is 0660: it goes to the pod's fsGroup, which every container of the pod has.
    let fs_group =
        yaml.lines().find_map(|l| l.trim().strip_prefix("fsGroup: ")).expect("the pod has an fsGroup");
    assert_eq!(sidecar.socket_group.as_deref(), Some(fs_group));
}

#[test]
fn a_misspelt_field_in_a_rendered_config_would_fail() {
    // The guard the two tests above rely on: unknown fields are errors, not ignored.
    assert!(toml::from_str::<WorkerConfig>("memory_capacty = 1").is_err());
    assert!(toml::from_str::<MasterConfig>("data_dirr = \"/x\"").is_err());
}

/// Tokens come from Secrets as files: every process that presents or accepts one names a file
/// under a Secret's mount, and no rendering holds a token or a token variable's value.
#[test]
fn rendered_tokens_come_from_secrets_never_from_configmaps_or_args() {
    for rel in [
        "base/strata.yaml",
        "examples/sidecar-job.yaml",
        "examples/warmup-cronjob.yaml",
        "examples/standalone.yaml",
    ] {
        let yaml = k8s(rel);
        assert!(!yaml.contains("token: strata_"), "{rel} holds a token");
        assert!(!yaml.contains("name: STRATA_TOKEN\n"), "{rel} passes a token by value");
        let lines: Vec<&str> = yaml.lines().collect();
        let files: Vec<&str> = lines
            .windows(2)
            .filter(|w| w[0].trim().starts_with("- name: STRATA_") && w[0].ends_with("TOKEN_FILE"))
            .filter_map(|w| w[1].trim().strip_prefix("value: "))
            .collect();
        assert!(!files.is_empty(), "{rel} presents no token");
        for file in files {
            assert!(
                file.starts_with("/etc/strata-tokens/") || file.starts_with("/etc/strata-token/"),
                "{rel}: {file} is not under a Secret's mount"
            );
        }
        assert!(yaml.contains("secretName: strata-tokens"), "{rel} mounts the tokens Secret");
    }
}

/// The objects of a rendered file, each as (kind, text).
fn objects(yaml: &str) -> Vec<(String, String)> {
    yaml.split("\n---")
        .filter_map(|doc| {
            let kind = doc.lines().find_map(|l| l.strip_prefix("kind: "))?;
            Some((kind.trim().to_string(), doc.to_string()))
        })
        .collect()
}

/// The fieldPath of each `STRATA_NODE` variable in `text`, in order (`None` for one that is
/// not set from the downward API).
fn node_env(text: &str) -> Vec<Option<String>> {
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    lines
        .iter()
        .enumerate()
        .filter(|(_, l)| **l == "- name: STRATA_NODE")
        .map(|(i, _)| match lines.get(i + 1..i + 4) {
            Some(["valueFrom:", "fieldRef:", path]) => path.strip_prefix("fieldPath: ").map(String::from),
            _ => None,
        })
        .collect()
}

/// Workers report the node they run on and example readers know theirs (the downward API's
/// `spec.nodeName`), and the workers' node label is what training pods ask for, so a reader can
/// land next to a worker that serves it (docs/CACHE_CONTROL.md, "Read replicas and locality").
#[test]
fn workers_and_example_readers_know_their_node_and_readers_ask_for_cache_nodes() {
    let from_node = || Some("spec.nodeName".to_string());
    let base = objects(&k8s("base/strata.yaml"));
    let (_, workers) = base.iter().find(|(k, _)| k == "DaemonSet").expect("the worker DaemonSet");
    assert_eq!(node_env(workers), [from_node()], "the worker container sets STRATA_NODE");
    let selector: Vec<&str> = workers
        .lines()
        .skip_while(|l| l.trim() != "nodeSelector:")
        .nth(1)
        .map(|l| l.trim().split(": ").collect())
        .expect("the workers have a nodeSelector");
    let (label, value) = (selector[0], selector[1].trim_matches('"'));
    assert_eq!((label, value), ("strata.io/cache-worker", "true"));
    for (kind, text) in &base {
        if kind != "DaemonSet" {
            assert!(node_env(text).is_empty(), "only workers report a node in the base ({kind})");
        }
    }

    let job = k8s("examples/sidecar-job.yaml");
    assert_eq!(node_env(&job), [from_node(), from_node()], "the sidecar and the trainer");
    let affinity: Vec<&str> =
        job.lines().map(str::trim).skip_while(|l| *l != "nodeAffinity:").take(8).collect();
    assert!(affinity.contains(&"preferredDuringSchedulingIgnoredDuringExecution:"), "{affinity:?}");
    assert!(affinity.contains(&format!("- key: {label}").as_str()), "the workers' label: {affinity:?}");
    assert!(affinity.contains(&format!("values: [\"{value}\"]").as_str()), "{affinity:?}");

    assert_eq!(node_env(&k8s("examples/standalone.yaml")), [from_node()]);
}

#[test]
fn a_cluster_worker_drains_on_sigterm_within_its_grace_period() {
    let base = k8s("base/strata.yaml");
    let args = base
        .lines()
        .find(|l| l.trim_start().starts_with("args: [\"worker\", \"--config\""))
        .expect("the worker's args");
    assert!(args.contains("\"--drain\""), "the worker hands its blocks off before it stops: {args}");
    let timeout: u64 = args
        .split("\"--drain-timeout\", \"")
        .nth(1)
        .and_then(|rest| rest.split("s\"").next())
        .and_then(|n| n.parse().ok())
        .expect("--drain-timeout in seconds");
    let graces: Vec<u64> = base
        .lines()
        .filter_map(|l| l.trim().strip_prefix("terminationGracePeriodSeconds: "))
        .map(|n| n.parse().expect("a number"))
        .collect();
    assert!(graces.iter().any(|g| *g > timeout), "a grace period covers the {timeout} s drain: {graces:?}");
}
