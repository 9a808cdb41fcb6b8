//! Membership: replicas registered and removed, and where each sits in the fleet's list.

use super::*;

impl Fleet {
    /// Registers a replica, ready for traffic — once its KV capacity is known: a spec of 0
    /// `capacity_blocks` (not known yet: a node reads it from the engine's metrics) is never
    /// routable until [`Fleet::set_capacity_blocks`] gives it.
    ///
    /// # Errors
    /// [`Error::DuplicateReplica`] for a name already registered; [`Error::InvalidConfig`] for
    /// a bad profile or block size.
    pub fn add_replica(&mut self, spec: ReplicaSpec) -> Result<ReplicaId, Error> {
        if self.replica_by_name(&spec.name).is_some() {
            return Err(Error::DuplicateReplica(spec.name));
        }
        spec.profile.validate()?;
        if self.next_id == u32::MAX {
            return Err(Error::InvalidConfig { field: "replicas", reason: "replica id space exhausted".into() });
        }
        let id = ReplicaId(self.next_id);
        self.next_id += 1;
        let key = self.hasher_for(&spec.model).model();
        let block_size = self.model_block_size(&spec, key)?;
        let name_key = xxh3_64(spec.name.as_bytes());
        self.bookings.set_prefill_rate(id, spec.profile.prefill_s_per_token / self.config.prefill_efficiency);
        if block_size != self.config.block_size {
            self.model_configs.insert(key, FleetConfig { block_size, ..self.config.clone() });
        } else {
            self.model_configs.remove(&key);
        }
        self.bookings.set_block_size(id, block_size);
        let hasher = self.hasher_for(&spec.model);
        self.index.register(id, (hasher != self.hasher).then_some(hasher));
        self.largest_blocks = self.largest_blocks.max(spec.capacity_blocks);
        // Ids only grow, so a new replica goes last and `replicas` stays sorted by id.
        self.positions.resize(id.index() + 1, NO_POSITION);
        self.positions[id.index()] = self.replicas.len() as u32;
        self.replicas.push(ReplicaState {
            id,
            spec,
            name_key,
            model: hasher.model(),
            status: ReplicaStatus::Ready,
            last_event_at: None,
            last_routed_at: None,
            last_first_token_at: None,
            events_usable: true,
            metrics: None,
            kv_booked_at_report: 0,
            prefill: Default::default(),
        });
        self.epoch += 1;
        Ok(id)
    }

    /// The block size a replica of `spec` would count in (its own, else its model's), checked
    /// as [`Fleet::add_replica`] checks it.
    ///
    /// # Errors
    /// As [`Fleet::add_replica`]'s for the block size.
    pub fn block_size_for(&self, spec: &ReplicaSpec) -> Result<u32, Error> {
        self.model_block_size(spec, self.hasher_for(&spec.model).model())
    }

    /// The block size `spec` (of model `key`) counts in: its own, else its model's.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for another block size than its model's replicas', or than the
    /// fleet's for the namespace model.
    fn model_block_size(&self, spec: &ReplicaSpec, key: ModelKey) -> Result<u32, Error> {
        let of_model = self.replicas.iter().any(|r| r.model == key);
        let want = self.block_size_of(Some(key));
        let bs = if spec.block_size == 0 { want } else { spec.block_size };
        let fixed = key == self.hasher.model() || of_model;
        if bs != want && fixed {
            return Err(Error::InvalidConfig {
                field: "block_size",
                reason: format!(
                    "replica {:?} has {bs}-token blocks, but its model's replicas have {want}-token blocks (one \
                     block size per model)",
                    spec.name
                ),
            });
        }
        Ok(bs)
    }

    /// Removes a replica: its blocks, routing record and bookings go with it. Returns how many
    /// live bookings were dropped.
    ///
    /// # Errors
    /// [`Error::UnknownReplica`].
    pub fn remove_replica(&mut self, id: ReplicaId) -> Result<usize, Error> {
        let p = self.pos(id).ok_or(Error::UnknownReplica(id))?;
        let gone = self.replicas.remove(p);
        self.largest_blocks = self.replicas.iter().map(|r| r.spec.capacity_blocks).max().unwrap_or(0);
        self.positions[id.index()] = NO_POSITION;
        for (q, r) in self.replicas.iter().enumerate().skip(p) {
            self.positions[r.id.index()] = q as u32;
        }
        if !self.replicas.iter().any(|r| r.model == gone.model) {
            // The model's last replica: a new one may come with another block size.
            self.model_configs.remove(&gone.model);
        }
        self.index.remove_replica(id);
        self.record.forget_replica(id);
        self.epoch += 1;
        let bookings = &self.bookings;
        let mut gone: Vec<BookingId> =
            self.own.iter().copied().filter(|b| bookings.get(*b).is_some_and(|x| x.replica == id)).collect();
        gone.sort_unstable();
        for b in gone {
            self.own.remove(&b);
            self.lifecycle.push(FleetEvent::Ended(b));
        }
        self.lifecycle.push(FleetEvent::ReplicaRemoved(id));
        Ok(self.bookings.drop_replica(id))
    }

    /// Sets the KV capacity of replica `id`, blocks (its engine's own figure, as vLLM
    /// reports `num_gpu_blocks`): a replica registered without one becomes routable (if its
    /// status is). Returns whether it changed.
    ///
    /// # Errors
    /// [`Error::UnknownReplica`]; [`Error::InvalidConfig`] for 0 blocks.
    pub fn set_capacity_blocks(&mut self, id: ReplicaId, blocks: u64) -> Result<bool, Error> {
        let p = self.pos(id).ok_or(Error::UnknownReplica(id))?;
        if blocks == 0 {
            return Err(Error::InvalidConfig {
                field: "capacity_blocks",
                reason: format!("replica {:?}: 0 blocks", self.replicas[p].spec.name),
            });
        }
        let was = std::mem::replace(&mut self.replicas[p].spec.capacity_blocks, blocks);
        if was == blocks {
            return Ok(false);
        }
        self.largest_blocks = self.replicas.iter().map(|r| r.spec.capacity_blocks).max().unwrap_or(0);
        // Policies rebuild what they keep per replica (llm-d's LRU sizes), and a replica that
        // had none may now be routable.
        self.epoch += 1;
        Ok(true)
    }

    #[inline]
    pub(super) fn pos(&self, id: ReplicaId) -> Option<usize> {
        position(&self.positions, id)
    }
}

/// "No such replica" in [`Fleet`]'s id → position map.
pub(super) const NO_POSITION: u32 = u32::MAX;

/// `id`'s position in the fleet's replicas, from its id → position map `positions`.
#[inline]
pub(super) fn position(positions: &[u32], id: ReplicaId) -> Option<usize> {
    positions.get(id.index()).copied().filter(|&p| p != NO_POSITION).map(|p| p as usize)
}
