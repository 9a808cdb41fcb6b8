//! Compiles `proto/kvmesh/v1/*.proto` with protox (pure Rust: no system `protoc`), generates
//! tonic clients and servers, and writes the descriptor set that gRPC server reflection serves.

use prost::Message;
use std::path::PathBuf;

const PROTOS: &[&str] = &[
    "kvmesh/v1/router.proto",
    "kvmesh/v1/admin.proto",
    "kvmesh/v1/events.proto",
    "kvmesh/v1/cluster.proto",
    "kvmesh/v1/replication.proto",
    "kvmesh/v1/autoscaler.proto",
    "externalscaler/externalscaler.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    for p in PROTOS {
        println!("cargo:rerun-if-changed={}", root.join(p).display());
    }
    let fds = protox::compile(PROTOS, [&root])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("kvmesh_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
