//! kvmesh-proto: kvmesh's gRPC API (`proto/kvmesh/v1/`), generated at build time by protox and
//! tonic-prost-build, plus conversions between its messages and [`kvmesh_core`] types.
//!
//! - [`v1`]: the `kvmesh.v1` package — `Router`, `Admin` and `Events` services, their clients
//!   (`v1::router_client::RouterClient`, …) and servers (`v1::router_server::RouterServer`, …).
//! - [`FILE_DESCRIPTOR_SET`]: the compiled descriptors, for gRPC server reflection.
//! - [`convert`]: wire messages ↔ core types; [`gossip`]: booking deltas ↔ core gossip types;
//!   [`replication`]: hot-prefix reports and the replication plan.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod convert;
pub mod gossip;
pub mod replication;

/// The `kvmesh.v1` package, generated from `proto/kvmesh/v1/*.proto`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod v1 {
    tonic::include_proto!("kvmesh.v1");
}

/// KEDA's external scaler protocol (`proto/externalscaler/externalscaler.proto`).
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod externalscaler {
    tonic::include_proto!("externalscaler");
}

/// The encoded `FileDescriptorSet` of every kvmesh proto (serve it with tonic-reflection so
/// `grpcurl` can list and call the services without the `.proto` files).
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kvmesh_descriptor.bin"));
