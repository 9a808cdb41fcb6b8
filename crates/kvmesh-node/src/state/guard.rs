//! The core's lock guard. Status changes found under the lock are queued on the core and
//! logged once the guard has released it: a log write (stderr, perhaps a slow pipe) never
//! holds up the decisions waiting for the lock.

use super::Core;
use parking_lot::MutexGuard;
use std::ops::{Deref, DerefMut};

/// The locked core ([`super::Shared::core`]); logs the queued status changes on drop, after
/// unlocking.
pub struct CoreGuard<'a> {
    inner: Option<MutexGuard<'a, Core>>,
}

impl<'a> CoreGuard<'a> {
    pub(super) fn new(inner: MutexGuard<'a, Core>) -> Self {
        CoreGuard { inner: Some(inner) }
    }
}

impl Deref for CoreGuard<'_> {
    type Target = Core;
    fn deref(&self) -> &Core {
        self.inner.as_deref().expect("the guard holds the lock until dropped")
    }
}

impl DerefMut for CoreGuard<'_> {
    fn deref_mut(&mut self) -> &mut Core {
        self.inner.as_deref_mut().expect("the guard holds the lock until dropped")
    }
}

impl Drop for CoreGuard<'_> {
    fn drop(&mut self) {
        let Some(mut core) = self.inner.take() else { return };
        // Taking an empty Vec allocates nothing: the common section pays nothing here.
        let changes = std::mem::take(&mut core.status_changes);
        drop(core);
        for c in &changes {
            c.log();
        }
    }
}
