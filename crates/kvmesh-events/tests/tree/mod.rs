//! The decoder kvmesh-events had before it read msgpack in place (through an `rmpv::Value`
//! tree, as of commit 762cd60), kept as an oracle for `same_as_tree.rs`. Two changes since,
//! made in both: a token id that is not an integer is named by its type (it was printed whole,
//! whatever its size), and rmpv's depth limit no longer cuts below the budget's.

pub mod batch;
pub mod event;
