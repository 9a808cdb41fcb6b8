//! The query's walk along a long chain: eight blocks at a time where the holder word repeats,
//! block by block where it changes, with exact overlaps.

use super::*;

/// `n` blocks of `BS` tokens each, token `t` at position `t`.
fn tokens(n: u32) -> Vec<u32> {
    (0..n * BS).collect()
}

fn overlaps(ix: &PrefixIndex, toks: &[u32]) -> Vec<(ReplicaId, Overlap)> {
    let mut out = Vec::new();
    ix.overlaps(&ix.hasher().hash_blocks(toks), &mut out);
    out
}

#[test]
fn holders_changing_inside_a_group_of_eight_are_stepped_exactly() {
    let mut ix = index();
    let toks = tokens(40);
    let b = BS as usize;
    // R0 holds the whole 40-block chain, engine ids 1..=40 (block k has id k + 1).
    let ids: Vec<u64> = (1..=40).collect();
    assert_eq!(ix.apply(R0, &stored(&ids, None, toks.clone())).stored, 40);
    // R1 holds blocks 0..5 and R2 blocks 0..3: shared lists there, R0's own word after.
    assert_eq!(ix.apply(R1, &stored(&ids[..5], None, toks[..5 * b].to_vec())).stored, 5);
    let r2 = ReplicaId(2);
    assert_eq!(ix.apply(r2, &stored(&ids[..3], None, toks[..3 * b].to_vec())).stored, 3);
    // A second copy of block 12 under the same id: its holder word differs from its
    // neighbours' (two copies), its holders do not.
    assert_eq!(ix.apply(R0, &stored(&[13], Some(12), toks[12 * b..13 * b].to_vec())).stored, 1);
    // R0 also holds block 20 in CPU memory (its CPU run would start at block 0: it is 0 long).
    let cpu = match stored(&[21], Some(20), toks[20 * b..21 * b].to_vec()) {
        KvEvent::Stored(s) => KvEvent::Stored(Stored { medium: Medium::Cpu, ..s }),
        _ => unreachable!(),
    };
    assert_eq!(ix.apply(R0, &cpu).stored, 1);
    let want = vec![(R0, Overlap::gpu(40)), (R1, Overlap::gpu(5)), (r2, Overlap::gpu(3))];
    assert_eq!(overlaps(&ix, &toks), want);
    // A prompt that leaves the chain at block 30 (inside a group of eight): the match stops there.
    let mut other = toks.clone();
    other[30 * b] = 9_999;
    let want = vec![(R0, Overlap::gpu(30)), (R1, Overlap::gpu(5)), (r2, Overlap::gpu(3))];
    assert_eq!(overlaps(&ix, &other), want);
    // The second copy of block 12 removed, then block 33 (a hole nobody holds, inside a group):
    // R0's run ends at 33.
    ix.apply(R0, &removed(&[13]));
    ix.apply(R0, &removed(&[34]));
    let want = vec![(R0, Overlap::gpu(33)), (R1, Overlap::gpu(5)), (r2, Overlap::gpu(3))];
    assert_eq!(overlaps(&ix, &toks), want);
}
