//! Terminal tables (comfy-table): borderless, names left and numbers right, one row per line
//! whatever the terminal's width, so `kvmesh status | grep` and `awk` keep working.

use comfy_table::{presets::NOTHING, CellAlignment, Table};

/// A borderless table with `header`; the columns at the indexes in `right` (numbers) are
/// right-aligned, the others left-aligned.
pub fn plain(header: &[&str], right: &[usize]) -> Table {
    let mut t = Table::new();
    t.load_preset(NOTHING);
    t.set_header(header.to_vec());
    for &i in right {
        if let Some(c) = t.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    t
}

/// `t` as lines, each without the trailing padding of its last column.
pub fn lines(t: &Table) -> String {
    t.lines().map(|l| l.trim_end().to_string()).collect::<Vec<_>>().join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align_names_left_and_numbers_right() {
        let mut t = plain(&["replica", "blocks"], &[1]);
        t.add_row(vec!["vllm-0", "7"]);
        t.add_row(vec!["e1", "12040"]);
        assert_eq!(lines(&t), " replica  blocks\n vllm-0        7\n e1        12040");
    }
}
