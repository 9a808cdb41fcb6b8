//! Compiles `proto/kvmesh/v1/*.proto` with protox (pure Rust: no system `protoc`), generates
//! tonic clients and servers, writes the descriptor set that gRPC server reflection serves, and
//! derives proto3 JSON (pbjson) for the `kvmesh.v1` messages, which the CLI's `--json` prints.

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
    let descriptors = fds.encode_to_vec();
    std::fs::write(out.join("kvmesh_descriptor.bin"), &descriptors)?;
    // Field names as in the .proto files (snake_case, as the CLI always printed them); every
    // field printed, defaults too, so a reader finds `running: 0` rather than no key.
    pbjson_build::Builder::new()
        .register_descriptors(&descriptors)?
        .preserve_proto_field_names()
        .emit_fields()
        .build(&[".kvmesh.v1"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
