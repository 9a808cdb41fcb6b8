//! docs/configuration.md is generated from the node's config types: every key of `[node]`,
//! `[[replicas]]`, `[cluster]`, `[security]`, `[replication]`, `[autoscaler]`, `[admission]`, `[limits]` and `[epp]` with its default and its doc comment, read from
//! the sources. This test fails when the file is stale; `KVMESH_BLESS=1 cargo test -p
//! kvmesh-tests --test suite t09_config_reference` rewrites it.

use kvmesh_node::auth::SecuritySection;
use kvmesh_node::config::{
    AdmissionSection, AutoscalerSection, ClusterSection, EppSection, LimitsSection, NodeSection, ReplicaConfig,
    ReplicationSection,
};
use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `(key, doc)` of `pub struct name` in `source`, in order; doc comments joined. A field's key
/// is its serde name (`#[serde(rename = "…")]`); `#[serde(skip)]` fields are left out; a
/// `#[serde(flatten)]` field's struct is read from `source` in its place, and a field whose
/// type is another struct of `source` (`sketch: SketchConfig`) becomes its keys, dotted.
fn fields(source: &str, name: &str) -> Vec<(String, String)> {
    let start = source.find(&format!("pub struct {name} {{")).unwrap_or_else(|| panic!("struct {name} not found"));
    let body = &source[start..];
    let body = &body[..body.find("\n}").unwrap()];
    let mut out = Vec::new();
    let mut doc: Vec<String> = Vec::new();
    let (mut rename, mut skip, mut flatten) = (None, false, false);
    for line in body.lines().skip(1) {
        let t = line.trim();
        if let Some(d) = t.strip_prefix("///") {
            doc.push(d.trim().to_string());
        } else if let Some(rest) = t.strip_prefix("pub ") {
            let (field, ty) = rest.split_once(':').unwrap();
            let ty = ty.trim().trim_end_matches(',');
            let key = rename.take().unwrap_or_else(|| field.trim().to_string());
            if flatten {
                out.extend(fields(source, ty));
            } else if !skip && source.contains(&format!("pub struct {ty} {{")) {
                out.extend(fields(source, ty).into_iter().map(|(k, d)| (format!("{key}.{k}"), d)));
            } else if !skip {
                out.push((key, doc.join(" ")));
            }
            doc.clear();
            (skip, flatten) = (false, false);
        } else if let Some(attr) = t.strip_prefix("#[serde(") {
            skip |= attr.starts_with("skip)");
            flatten |= attr.starts_with("flatten)");
            rename = attr.split_once("rename = \"").map(|(_, r)| r.split('"').next().unwrap().to_string());
        } else if !t.starts_with("#[") {
            doc.clear();
        }
    }
    out
}

/// Every file of the config module, one concatenated source (each section in its own file),
/// and the core's configs that `[autoscaler]` and `[replication]` are read into.
fn sources() -> String {
    let dir = root().join("crates/kvmesh-node/src/config");
    // The section files (the tests' folder holds no section).
    let mut files: Vec<PathBuf> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.is_file()).collect();
    files.sort();
    for core in ["autoscale/mod.rs", "replication/mod.rs", "replication/sketch.rs"] {
        files.push(root().join("crates/kvmesh-core/src").join(core));
    }
    files.iter().map(|f| std::fs::read_to_string(f).unwrap()).collect()
}

fn defaults<T: serde::Serialize>(v: &T) -> toml::Table {
    toml::from_str(&toml::to_string(v).unwrap()).unwrap()
}

fn section(out: &mut String, title: &str, fields: &[(String, String)], defaults: &toml::Table, required: &[&str]) {
    out.push_str(&format!("\n## `{title}`\n\n| key | default | meaning |\n|---|---|---|\n"));
    for (key, doc) in fields {
        let default = if required.contains(&key.as_str()) {
            "required".to_string()
        } else {
            // A dotted key (`sketch.capacity`) is a nested table's.
            let mut path = key.split('.');
            let first = defaults.get(path.next().unwrap());
            let value = path.fold(first, |v, k| v.and_then(|v| v.get(k)));
            value.map_or("(none)".to_string(), |v| format!("`{v}`"))
        };
        out.push_str(&format!("| `{key}` | {default} | {} |\n", doc.replace('|', "\\|")));
    }
}

fn generate() -> String {
    let config = sources();
    let auth = std::fs::read_to_string(root().join("crates/kvmesh-node/src/auth.rs")).unwrap();
    let mut out = String::from(
        "# kvmesh node configuration reference\n\n\
         Generated from the config types in `crates/kvmesh-node/src/config/` and `auth.rs` by\n\
         `tests/tests/suite/t09_config_reference.rs` (`KVMESH_BLESS=1 cargo test -p kvmesh-tests\n\
         --test suite t09_config_reference` after changing them). `kvmesh node --config FILE` reads TOML; unknown\n\
         keys are errors. Durations are text with a unit (`\"250ms\"`, `\"2s\"`, `\"1m 30s\"`; the `humantime`\n\
         crate's grammar); before 2026-12-07 they were numbers in keys ending `_ms` or `_s`, which the node\n\
         now refuses, saying what to write instead. Cluster keys can also come from flags and environment variables (`--id`/\n\
         `KVMESH_NODE_ID`, `--raft-addr`/`KVMESH_RAFT_ADDR`, `--peers`/`KVMESH_PEERS`, `--data-dir`/\n\
         `KVMESH_DATA_DIR`), tokens from `KVMESH_ADMIN_TOKEN` and `KVMESH_CLUSTER_TOKEN`.\n",
    );
    section(&mut out, "[node]", &fields(&config, "NodeSection"), &defaults(&NodeSection::default()), &[]);
    out.push_str("\nOne `[[replicas]]` table per engine replica.\n");
    let minimal: ReplicaConfig = toml::from_str("name = \"x\"\nhttp = \"http://x\"").unwrap();
    let required = ["name", "http"];
    section(&mut out, "[[replicas]]", &fields(&config, "ReplicaConfig"), &defaults(&minimal), &required);
    section(&mut out, "[cluster]", &fields(&config, "ClusterSection"), &defaults(&ClusterSection::default()), &[]);
    section(&mut out, "[security]", &fields(&auth, "SecuritySection"), &defaults(&SecuritySection::default()), &[]);
    let replication = defaults(&ReplicationSection::default());
    section(&mut out, "[replication]", &fields(&config, "ReplicationSection"), &replication, &[]);
    let autoscaler = defaults(&AutoscalerSection::default());
    section(&mut out, "[autoscaler]", &fields(&config, "AutoscalerSection"), &autoscaler, &[]);
    let admission = defaults(&AdmissionSection::default());
    section(&mut out, "[admission]", &fields(&config, "AdmissionSection"), &admission, &[]);
    let limits = defaults(&LimitsSection::default());
    section(&mut out, "[limits]", &fields(&config, "LimitsSection"), &limits, &[]);
    section(&mut out, "[epp]", &fields(&config, "EppSection"), &defaults(&EppSection::default()), &[]);
    out
}

#[test]
fn the_configuration_reference_is_current() {
    let path = root().join("docs/configuration.md");
    let fresh = generate();
    if std::env::var_os("KVMESH_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &fresh).unwrap();
    }
    let current = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        current == fresh,
        "docs/configuration.md is stale: run KVMESH_BLESS=1 cargo test -p kvmesh-tests --test suite t09_config_reference"
    );
    // Every section of the config file has its table (a section's keys come back dotted).
    let mut sections: Vec<String> =
        fields(&sources(), "NodeConfig").into_iter().map(|(k, _)| k.split('.').next().unwrap().to_string()).collect();
    sections.dedup();
    for name in sections {
        let heading = if name == "replicas" { "[[replicas]]".to_string() } else { format!("[{name}]") };
        assert!(fresh.contains(&format!("## `{heading}`")), "no table for {heading}");
    }
    // Every key documented.
    for line in fresh.lines().filter(|l| l.starts_with("| `")) {
        assert!(!line.ends_with("|  |"), "undocumented key: {line}");
    }
}
