//! The index's write side: stores chained onto their parents (full attention and sliding
//! windows), removals, clears, and the holder lists they keep.

use super::*;

impl PrefixIndex {
    pub(super) fn slot(&mut self, replica: ReplicaId) -> &mut ReplicaBlocks {
        let i = replica.index();
        if self.replicas.len() <= i {
            self.replicas.resize_with(i + 1, || None);
        }
        let seed = self.seed;
        self.replicas[i].get_or_insert_with(|| ReplicaBlocks::with_seed(seed))
    }

    /// What makes store `s` unusable for `replica` whatever it holds (cases C02, C04): another
    /// block size than its hasher's, token ids that are not whole blocks, a block chained to
    /// itself.
    pub(super) fn malformed(&self, replica: ReplicaId, s: &Stored) -> Option<Rejection> {
        let want = self.hasher_of(replica).block_size();
        if s.block_size != want {
            return Some(Rejection::BlockSizeMismatch { got: s.block_size, want });
        }
        if s.token_ids.len() as u64 != s.block_hashes.len() as u64 * want as u64 {
            return Some(Rejection::TokenCountMismatch);
        }
        is_self_referential(s).then_some(Rejection::SelfReferential)
    }

    pub(super) fn store(&mut self, replica: ReplicaId, s: &Stored) -> ApplyOutcome {
        let mut out = ApplyOutcome { rejection: self.malformed(replica, s), ..ApplyOutcome::default() };
        if out.rejection.is_some() {
            return out;
        }
        let m = s.medium.index();
        let rb = self.replicas[replica.index()].as_ref().expect("slot registered by apply");
        let mut prev = match s.parent {
            None => None,
            Some(p) => match rb.engine[m].get(p.0).or_else(|| rb.engine[1 - m].get(p.0)) {
                Some(&v) => Some(Mapping::unpack(v).pos),
                None => {
                    out.rejection = Some(Rejection::UnknownParent);
                    return out;
                }
            },
        };
        // Hash every block first, then read the table slots the loop below will probe: the
        // reads are independent, so their cache misses overlap instead of coming one by one.
        let mut blocks = std::mem::take(&mut self.scratch);
        let parent_hash = prev.map(|p| BlockHash(self.blocks.slot(p).hash));
        self.chain(replica, s, parent_hash, &mut blocks);
        let mut sink = 0;
        for (block, engine_hash) in blocks.iter().zip(&s.block_hashes) {
            sink ^= self.blocks.touch_start(block.0) ^ rb.engine[m].touch(engine_hash.0);
        }
        std::hint::black_box(sink);
        let n = s.block_hashes.len();
        for (k, (&engine_hash, &block)) in s.block_hashes.iter().zip(&blocks).enumerate() {
            let pos = self.blocks.locate_or_insert(prev, block.0, n - k);
            // One probe for the common case, a new id: its mapping is written here, as the
            // one copy it will count, and taken back below in the rare case it is not counted.
            let rb = self.replicas[replica.index()].as_mut().expect("slot registered by apply");
            let (v, new) = rb.engine[m].entry(engine_hash.0, Mapping { pos, copies: 1 }.pack());
            let old = (!new).then(|| Mapping::unpack(*v));
            let copies = match old {
                // The same id for the same block again: one more copy (case C20), up to what
                // the mapping counts; past that the store is counted and changes nothing.
                Some(o) if o.pos == pos && o.copies == u8::MAX => None,
                Some(o) if o.pos == pos => Some(o.copies + 1),
                _ => Some(1),
            };
            // The block gets its copy before an old block of this id loses its own (that may
            // empty a slot, which must never be this one). A copy the holder cannot count (it
            // saturates too) is not counted under the id either, so the two always agree.
            let copies = copies.filter(|_| self.add_copy(replica, pos, s.medium));
            let rb = self.replicas[replica.index()].as_mut().expect("slot registered by apply");
            match copies {
                Some(copies) if !new => {
                    rb.engine[m].insert(engine_hash.0, Mapping { pos, copies }.pack());
                }
                None if new => {
                    rb.engine[m].remove(engine_hash.0);
                }
                _ => {}
            }
            if let Some(o) = old.filter(|o| o.pos != pos) {
                // The engine reused an id for other tokens: trust the newest event and drop
                // the copies the old block had under this id.
                if copies.is_none() {
                    let rb = self.replicas[replica.index()].as_mut().expect("slot registered by apply");
                    rb.engine[m].remove(engine_hash.0);
                }
                self.drop_copies(replica, o.pos, s.medium, o.copies as u16);
                out.rejection.get_or_insert(Rejection::ConflictingBlock);
            }
            prev = Some(pos);
            out.stored += 1;
        }
        self.scratch = blocks;
        out
    }

    /// `s`'s blocks' hashes into `out` (cleared first), chained from `parent` (`None`: a
    /// sequence's start) with `replica`'s hasher; a block with a key no request shows
    /// (multimodal, embeddings) hashes apart, and so does the rest of its chain.
    pub(super) fn chain(&self, replica: ReplicaId, s: &Stored, parent: Option<BlockHash>, out: &mut Vec<BlockHash>) {
        let hasher = self.store_hasher(replica, s, parent.is_none());
        let unverifiable = s.extra_keys.as_ref().map_or(&[][..], |e| &e.unverifiable[..]);
        out.clear();
        let mut parent = parent;
        for (k, tokens) in s.token_ids.chunks_exact(hasher.block_size() as usize).enumerate() {
            let mut block = hasher.hash_block(parent, tokens);
            if let Some(&extra) = unverifiable.get(k).filter(|&&d| d != 0) {
                block = BlockHasher::with_extra(block, extra);
            }
            out.push(block);
            parent = Some(block);
        }
    }

    /// The hasher `replica`'s store `s` is hashed with: a sequence's first block (`starts`)
    /// carries its adapter and salt in its seed; later stores chain from their parent, whose
    /// hash already includes them.
    pub(super) fn store_hasher(&self, replica: ReplicaId, s: &Stored, starts: bool) -> BlockHasher {
        let base = self.hasher_of(replica);
        let hasher = match &s.lora_name {
            Some(adapter) if starts => base.for_adapter(adapter),
            _ => base,
        };
        let salt = s.extra_keys.as_ref().and_then(|e| e.cache_salt.as_deref()).filter(|_| starts);
        salt.map_or(hasher, |salt| hasher.for_salt(salt))
    }

    /// Adds one copy of the block at `pos` for `replica` in `medium`; false when the holder
    /// already counts as many as it can and nothing was added.
    pub(super) fn add_copy(&mut self, replica: ReplicaId, pos: Pos, medium: Medium) -> bool {
        let h = self.blocks.holder_mut(pos);
        let added = if h.is_empty() {
            *h = Holder::one(replica, medium);
            self.blocks.occupied(pos);
            Added::NewHolder
        } else {
            self.arena.add(h, replica, medium)
        };
        self.entries += (added == Added::NewHolder) as usize;
        self.refresh_same(pos);
        added != Added::Full
    }

    /// Removes `n` of `replica`'s copies of the block at `pos` in `medium`, emptying the slot
    /// when nobody holds the block any more.
    pub(super) fn drop_copies(&mut self, replica: ReplicaId, pos: Pos, medium: Medium, n: u16) {
        let h = self.blocks.holder_mut(pos);
        if h.is_empty() {
            return;
        }
        let r = self.arena.remove(h, replica, medium, n);
        if r.block_empty {
            *h = Holder::default();
            self.blocks.vacated(pos);
        }
        self.entries -= r.replica_gone as usize;
        self.refresh_same(pos);
    }

    /// Re-marks whether the lists at `pos` and after it equal their previous slot's, after
    /// `pos`'s holders changed.
    pub(super) fn refresh_same(&mut self, pos: Pos) {
        for off in [pos.off, pos.off + 1] {
            if let Some((previous, h)) = self.blocks.with_previous(Pos { seg: pos.seg, off }) {
                self.arena.refresh_same(previous.as_ref(), h);
            }
        }
    }

    /// [`Self::store`], keeping a store with an unknown parent aside while the replica's
    /// history is partial, and placing the stores that waited for the blocks it stored.
    pub(super) fn store_or_keep(&mut self, replica: ReplicaId, s: &Stored) -> ApplyOutcome {
        let mut out = self.store(replica, s);
        let rb = self.replicas[replica.index()].as_mut().expect("slot registered by apply");
        if out.rejection == Some(Rejection::UnknownParent) {
            if let (true, Some(parent)) = (rb.partial_history, s.parent) {
                out.orphans_dropped += rb.orphans.keep(parent.0, s.clone()) as u32;
                out.orphaned += s.block_hashes.len() as u32;
                out.rejection = None;
            }
            return out;
        }
        if out.stored == 0 || rb.orphans.blocks() == 0 {
            return out;
        }
        // Its blocks may be parents the waiting stores named: place those, then theirs.
        let mut stack: Vec<u64> = s.block_hashes.iter().map(|h| h.0).collect();
        while let Some(id) = stack.pop() {
            let rb = self.replicas[replica.index()].as_mut().expect("slot registered by apply");
            for child in rb.orphans.take_children(id) {
                let placed = self.store(replica, &child);
                if placed.stored > 0 {
                    out.adopted += placed.stored;
                    stack.extend(child.block_hashes.iter().map(|h| h.0));
                }
            }
        }
        out
    }

    /// Position in `replica`'s window groups of group `idx`, if it is one.
    pub(super) fn window_group(&self, replica: ReplicaId, idx: u32) -> Option<usize> {
        let rb = self.replicas.get(replica.index())?.as_ref()?;
        rb.windows.iter().position(|g| g.idx == idx)
    }

    /// A store of a sliding-window group ([`window`]): chained from its parent's hash (in the
    /// group, else in the full-attention chains: vLLM names a block by the same hash in every
    /// group); a parent known nowhere leaves the store aside.
    pub(super) fn store_window(&mut self, replica: ReplicaId, s: &Stored) -> ApplyOutcome {
        if let Some(rejection) = self.malformed(replica, s) {
            return ApplyOutcome { rejection: Some(rejection), ..ApplyOutcome::default() };
        }
        let want = self.hasher_of(replica).block_size();
        let Some(group) = s.kv_group.as_ref() else { return ApplyOutcome::default() };
        let window = group.window().unwrap_or(0);
        let g = match self.window_group(replica, group.idx) {
            Some(g) => g,
            None => {
                self.slot(replica).windows.push(window::WindowGroup::new(group.idx, window, want));
                self.windowed = true;
                self.slot(replica).windows.len() - 1
            }
        };
        let rb = self.replicas[replica.index()].as_ref().expect("slot registered above");
        let parent = match s.parent {
            None => None,
            Some(p) => {
                let m = s.medium.index();
                let known = rb.windows[g]
                    .hash_of(p.0)
                    .or_else(|| rb.engine[m].get(p.0).map(|&v| self.blocks.slot(Mapping::unpack(v).pos).hash));
                match known {
                    Some(h) => Some(BlockHash(h)),
                    None => return ApplyOutcome { other_group: s.block_hashes.len() as u32, ..Default::default() },
                }
            }
        };
        let mut blocks = std::mem::take(&mut self.scratch);
        self.chain(replica, s, parent, &mut blocks);
        let stored = self.slot(replica).windows[g].store(&s.block_hashes, &blocks);
        self.scratch = blocks;
        ApplyOutcome { stored, ..ApplyOutcome::default() }
    }

    pub(super) fn remove(&mut self, replica: ReplicaId, r: &Removed) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        let m = r.medium.index();
        if let Some(Some(rb)) = self.replicas.get(replica.index()) {
            let sink = r.block_hashes.iter().fold(0, |x, h| x ^ rb.engine[m].touch(h.0));
            std::hint::black_box(sink);
        }
        for engine_hash in &r.block_hashes {
            let rb = self.replicas[replica.index()].as_mut().expect("slot registered by apply");
            // Copies are counted per engine id: the id's mapping goes with its last copy, so
            // no id ever points at a slot its replica no longer holds.
            let fewer = |v| {
                let o = Mapping::unpack(v);
                (o.copies > 1).then(|| Mapping { copies: o.copies - 1, ..o }.pack())
            };
            let Some(o) = rb.engine[m].update(engine_hash.0, fewer).map(Mapping::unpack) else {
                out.rejection.get_or_insert(Rejection::UnknownBlock);
                continue;
            };
            self.drop_copies(replica, o.pos, r.medium, 1);
            out.removed += 1;
        }
        out
    }

    pub(super) fn clear(&mut self, replica: ReplicaId) -> u32 {
        let Some(Some(rb)) = self.replicas.get_mut(replica.index()) else { return 0 };
        let maps = [
            std::mem::replace(&mut rb.engine[0], Table::with_seed(self.seed)),
            std::mem::replace(&mut rb.engine[1], Table::with_seed(self.seed)),
        ];
        let mut cleared = 0;
        for (medium, map) in Medium::ALL.into_iter().zip(maps) {
            for (_, v) in map.iter() {
                let o = Mapping::unpack(v);
                cleared += o.copies as u32;
                self.drop_copies(replica, o.pos, medium, o.copies as u16);
            }
        }
        let rb = self.replicas[replica.index()].as_mut().expect("checked above");
        rb.orphans.clear();
        rb.inferred.clear();
        rb.windows.clear();
        rb.health.out_of_sync = false;
        rb.health.counters.clears += 1;
        cleared
    }
}
