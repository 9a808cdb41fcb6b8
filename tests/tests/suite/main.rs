//! kvmesh's cross-crate integration tests in one binary: a module per area (`tNN_*`, listed in
//! tests/README.md), sharing the fixtures of `common`. One binary links the node once instead of
//! once per area, and its tests share one port counter. Run one area with
//! `cargo test -p kvmesh-tests --test suite t05_node_cases`.
//!
//! `t08_telemetry` is a binary of its own: it installs the process's global tracing subscriber
//! and OpenTelemetry provider and sets `OTEL_SERVICE_NAME`, which every test running beside it
//! in one process would see.

#[path = "../common/mod.rs"]
mod common;

mod t01_traces;
mod t02_index_on_traces;
mod t04_node_e2e;
mod t05_node_cases;
mod t06_cluster;
mod t07_deploy;
mod t09_config_reference;
mod t10_replication;
mod t11_tls;
mod t12_autoscaler;
mod t13_faithful_peers;
mod t14_router_restart;
mod t15_lora_adapters;
mod t16_endpoint_picker;
mod t17_models;
mod t18_data_parallel;
mod t19_partial_history;
mod t20_hybrid;
mod t21_output_lengths;
mod t22_disaggregated;
mod t23_house;
