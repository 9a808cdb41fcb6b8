//! The decoder kvmesh-events had before it read msgpack in place (through an `rmpv::Value`
//! tree, as of commit 762cd60), kept as an oracle for `same_as_tree.rs`.

pub mod batch;
pub mod event;
