//! The house: no import circle between the modules of any crate, and no Rust file over 500
//! lines (small files, one concept each).
//!
//! At every level of each crate's module tree, the sibling modules (each taken with its
//! submodules) must depend on one another without a circle: a module may use its children
//! and its children may use it (one folder is one unit), but siblings form layers. Read from
//! the sources: every `crate::…`, `super::…` and child-module path outside comments and test
//! modules, with `pub use` re-exports followed to where the item is defined.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type ModPath = Vec<String>;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every module file of the crate rooted at `src` (lib.rs, or main.rs without a lib.rs),
/// by module path; binaries under `src/bin` and test modules are left out.
fn modules(src: &Path) -> BTreeMap<ModPath, String> {
    let has_lib = src.join("lib.rs").exists();
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            let rel: Vec<String> = p
                .strip_prefix(src)
                .unwrap()
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if p.is_dir() {
                if rel != ["bin"] {
                    stack.push(p);
                }
                continue;
            }
            let Some(stem) = rel.last().and_then(|f| f.strip_suffix(".rs")) else { continue };
            let mut path: ModPath = rel[..rel.len() - 1].to_vec();
            match stem {
                "lib" if rel.len() == 1 => {}
                "main" if rel.len() == 1 && has_lib => continue,
                "main" if rel.len() == 1 => {}
                "mod" => {}
                s => path.push(s.to_string()),
            }
            if path.iter().any(|m| m == "tests" || m.ends_with("_tests")) {
                continue;
            }
            out.insert(path, std::fs::read_to_string(&p).unwrap());
        }
    }
    out
}

/// The source without comment lines and without its inline `mod tests`.
fn code(source: &str) -> String {
    let kept: String = source.lines().filter(|l| !l.trim_start().starts_with("//")).map(|l| format!("{l}\n")).collect();
    match kept.find("#[cfg(test)]\nmod tests {") {
        Some(i) => kept[..i].to_string(),
        None => kept,
    }
}

fn ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The paths written after each `prefix` (`crate::` or `super::`): `a::b::C`, and for a
/// group `a::{b, c::D}` one path per member.
fn paths_after(code: &str, prefix: &str) -> Vec<ModPath> {
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(i) = code[at..].find(prefix) {
        let start = at + i;
        at = start + prefix.len();
        if code[..start].chars().next_back().is_some_and(|c| ident(c) || c == ':') {
            continue;
        }
        let rest = &code[at..];
        let head_len = rest.find(|c: char| !(ident(c) || c == ':')).unwrap_or(rest.len());
        let head: ModPath = rest[..head_len].split("::").filter(|s| !s.is_empty()).map(str::to_string).collect();
        if rest[head_len..].starts_with('{') && rest[..head_len].ends_with("::")
            || head_len == 0 && rest.starts_with('{')
        {
            let group = &rest[head_len + 1..];
            let mut depth = 0;
            let end = group
                .char_indices()
                .find(|&(_, c)| {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => return true,
                        '}' => depth -= 1,
                        _ => {}
                    }
                    false
                })
                .map_or(group.len(), |(k, _)| k);
            let mut depth = 0;
            let mut member = String::new();
            for c in group[..end].chars().chain([',']) {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        let first: ModPath = member
                            .trim()
                            .split("::")
                            .map(|s| s.trim().split(' ').next().unwrap_or("").to_string())
                            .take_while(|s| !s.is_empty() && !s.starts_with('{') && s != "self")
                            .collect();
                        out.push(head.iter().cloned().chain(first).collect());
                        member.clear();
                        continue;
                    }
                    _ => {}
                }
                member.push(c);
            }
        } else {
            out.push(head);
        }
    }
    out
}

/// `pub use a::b::{X, Y};`, `pub use a::b::X;` (also `pub(crate)` and `pub(super)`) of module
/// `at`: relative to it, or from `crate::` or `super::`.
fn reexports(at: &ModPath, code: &str, out: &mut BTreeMap<(ModPath, String), ModPath>) {
    for line in code.split(';') {
        let line = line.trim();
        let Some(rest) = ["pub use ", "pub(crate) use ", "pub(super) use "].iter().find_map(|p| line.strip_prefix(p))
        else {
            continue;
        };
        let rest = rest.trim();
        if ["std::", "kvmesh", "tokio::", "serde"].iter().any(|p| rest.starts_with(p)) || !rest.contains("::") {
            continue;
        }
        let (base, items) = match rest.split_once("::{") {
            Some((base, items)) => (base, items.trim_end_matches('}').split(',').collect::<Vec<_>>()),
            None => {
                let (base, item) = rest.rsplit_once("::").unwrap();
                (base, vec![item])
            }
        };
        let Some(target) = absolute(at, base.split("::").map(str::to_string).collect()) else { continue };
        for item in items {
            let name = item.trim().rsplit(' ').next().unwrap_or("").to_string();
            if !name.is_empty() && name != "self" {
                out.insert((at.clone(), name), target.clone());
            }
        }
    }
}

/// A path written in module `at` as an absolute module path: `crate::…`, `super::super::…`,
/// or relative to `at`; `None` for another crate's.
fn absolute(at: &ModPath, path: ModPath) -> Option<ModPath> {
    match path.first().map(String::as_str) {
        Some("crate") => Some(path[1..].to_vec()),
        Some("super") => {
            let ups = path.iter().take_while(|s| *s == "super").count();
            (ups <= at.len()).then(|| at[..at.len() - ups].iter().cloned().chain(path[ups..].iter().cloned()).collect())
        }
        Some("self") => Some(at.iter().cloned().chain(path[1..].iter().cloned()).collect()),
        _ => Some(at.iter().cloned().chain(path).collect()),
    }
}

/// Each module's dependencies on other modules of its crate.
fn dependencies(mods: &BTreeMap<ModPath, String>) -> BTreeMap<ModPath, BTreeSet<ModPath>> {
    let codes: BTreeMap<&ModPath, String> = mods.iter().map(|(m, s)| (m, code(s))).collect();
    let mut re = BTreeMap::new();
    for (m, c) in &codes {
        reexports(m, c, &mut re);
    }
    let resolve = |mut path: ModPath| -> Option<ModPath> {
        for k in (1..=path.len()).rev() {
            if let Some(target) = re.get(&(path[..k - 1].to_vec(), path[k - 1].clone())) {
                path = target.iter().cloned().chain(path[k..].iter().cloned()).collect();
                break;
            }
        }
        (0..=path.len()).rev().map(|k| path[..k].to_vec()).find(|p| mods.contains_key(p))
    };
    let mut deps: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
    for (m, c) in &codes {
        let mut paths = paths_after(c, "crate::");
        for p in paths_after(c, "super::") {
            // `super::super::x` reads as `super` then `super::x`: count every step up.
            let ups = 1 + p.iter().take_while(|s| *s == "super").count();
            if ups <= m.len() {
                paths.push(m[..m.len() - ups].iter().cloned().chain(p.into_iter().skip(ups - 1)).collect());
            }
        }
        // A glob of the parent brings its child modules into scope: `sibling::X` after
        // `use super::*;` is a dependency on that sibling.
        if c.contains("use super::*;") && !m.is_empty() {
            let parent = &m[..m.len() - 1];
            for sibling in mods.keys().filter(|k| k.len() == m.len() && k.starts_with(parent) && *k != *m) {
                let name = sibling.last().unwrap();
                if paths_after(c, &format!("{name}::")).iter().any(|_| true) {
                    paths.push(sibling.clone());
                }
            }
        }
        for line in mods[*m].lines() {
            let l = line.trim();
            let decl = l.strip_prefix("pub ").or_else(|| l.strip_prefix("pub(crate) ")).unwrap_or(l);
            if let Some(child) = decl.strip_prefix("mod ").and_then(|r| r.strip_suffix(';')) {
                if c.contains(&format!("{child}::")) {
                    paths.push(m.iter().cloned().chain([child.to_string()]).collect());
                }
            }
        }
        for p in paths {
            if let Some(t) = resolve(p).filter(|t| t != *m) {
                deps.entry((*m).clone()).or_default().insert(t);
            }
        }
    }
    deps
}

/// The circles among siblings, each as `parent: a -> b -> … -> a`.
fn circles(mods: &BTreeMap<ModPath, String>) -> Vec<String> {
    let deps = dependencies(mods);
    let mut found = Vec::new();
    for parent in mods.keys() {
        let child_of =
            |m: &ModPath| (m.len() > parent.len() && m.starts_with(parent)).then(|| m[..=parent.len()].to_vec());
        let mut graph: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
        for (a, ts) in &deps {
            let Some(ka) = child_of(a) else { continue };
            for t in ts {
                if let Some(kt) = child_of(t).filter(|kt| *kt != ka) {
                    graph.entry(ka.clone()).or_default().insert(kt);
                }
            }
        }
        // A circle exists iff a depth-first walk meets a module still on its stack.
        let mut state: BTreeMap<ModPath, u8> = BTreeMap::new();
        fn walk(
            v: &ModPath,
            g: &BTreeMap<ModPath, BTreeSet<ModPath>>,
            state: &mut BTreeMap<ModPath, u8>,
            stack: &mut Vec<ModPath>,
            found: &mut Vec<Vec<ModPath>>,
        ) {
            state.insert(v.clone(), 1);
            stack.push(v.clone());
            for w in g.get(v).into_iter().flatten() {
                match state.get(w) {
                    Some(1) => {
                        let i = stack.iter().position(|s| s == w).unwrap();
                        let mut c = stack[i..].to_vec();
                        c.push(w.clone());
                        found.push(c);
                    }
                    Some(_) => {}
                    None => walk(w, g, state, stack, found),
                }
            }
            stack.pop();
            state.insert(v.clone(), 2);
        }
        let mut cycles = Vec::new();
        for v in graph.keys().cloned().collect::<Vec<_>>() {
            if !state.contains_key(&v) {
                walk(&v, &graph, &mut state, &mut Vec::new(), &mut cycles);
            }
        }
        for c in cycles {
            let names: Vec<String> = c.iter().map(|m| m.join("::")).collect();
            found.push(format!(
                "{}: {}",
                if parent.is_empty() { "crate".into() } else { parent.join("::") },
                names.join(" -> ")
            ));
        }
    }
    found
}

/// Every `.rs` file under `dir`, recursively (build output left out).
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() && !path.ends_with("target") {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_rust_file_is_over_500_lines() {
    let mut files = Vec::new();
    for dir in ["crates", "tests", "chaos"] {
        if root().join(dir).is_dir() {
            rust_files(&root().join(dir), &mut files);
        }
    }
    assert!(files.len() > 100, "found only {} files: wrong root?", files.len());
    let mut long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let n = std::fs::read_to_string(f).unwrap().lines().count();
            (n > 500).then(|| format!("{} ({n} lines)", f.strip_prefix(root()).unwrap_or(f).display()))
        })
        .collect();
    long.sort();
    assert!(long.is_empty(), "split these files (one concept each):\n{}", long.join("\n"));
}

#[test]
fn no_crate_has_an_import_circle_between_its_modules() {
    let mut crates: Vec<PathBuf> =
        std::fs::read_dir(root().join("crates")).unwrap().map(|e| e.unwrap().path().join("src")).collect();
    crates.push(root().join("tests/fixtures"));
    crates.sort();
    let mut bad = Vec::new();
    for src in &crates {
        let mods = modules(src);
        assert!(mods.len() > 1 || src.ends_with("fixtures"), "{} has no modules", src.display());
        for c in circles(&mods) {
            bad.push(format!("{}: {c}", src.strip_prefix(root()).unwrap_or(src).display()));
        }
    }
    assert!(bad.is_empty(), "import circles:\n{}", bad.join("\n"));
}

#[test]
fn the_circle_check_finds_a_circle_through_a_reexport_and_a_group() {
    let m = |p: &[&str], s: &str| (p.iter().map(|x| x.to_string()).collect::<ModPath>(), s.to_string());
    let mods: BTreeMap<ModPath, String> = [
        m(&[], "mod a;\nmod b;\nmod c;\npub use a::Thing;\n"),
        m(&["a"], "use crate::{b::{Other, x}, c};\npub struct Thing;\n"),
        // `b` reaches `a` through the crate root's re-export, and a comment is no dependency.
        m(&["b"], "// crate::c::Nothing\nuse crate::Thing;\npub struct Other;\n"),
        m(&["c"], "pub struct C;\n#[cfg(test)]\nmod tests {\n    use crate::a::Thing;\n}\n"),
    ]
    .into_iter()
    .collect();
    assert_eq!(circles(&mods), ["crate: a -> b -> a"]);

    // `super::super::`, a sibling reached through `use super::*`, and a `pub(crate) use` of an
    // absolute path each make an edge: p::x reaches r through q's re-export of r's R, and r
    // uses p, so p and r form a circle.
    let mods: BTreeMap<ModPath, String> = [
        m(&[], "mod p;\nmod q;\nmod r;\n"),
        m(&["p"], "mod x;\nmod y;\n"),
        m(&["p", "x"], "use super::super::q::R;\n"),
        m(&["p", "y"], "use super::*;\nfn f() -> x::X { todo!() }\n"),
        m(&["q"], "pub(crate) use crate::r::R;\n"),
        m(&["r"], "use super::p;\npub struct R;\n"),
    ]
    .into_iter()
    .collect();
    let deps = dependencies(&mods);
    let edges = |from: &[&str]| -> Vec<String> {
        let key: ModPath = from.iter().map(|s| s.to_string()).collect();
        deps.get(&key).map_or(vec![], |ts| ts.iter().map(|t| t.join("::")).collect())
    };
    assert_eq!(edges(&["p", "x"]), ["r"], "super::super::q::R is r's R, re-exported by q");
    assert_eq!(edges(&["p", "y"]), ["p", "p::x"], "x::X after use super::*");
    assert_eq!(circles(&mods), ["crate: p -> r -> p"]);
    let deps = dependencies(&mods);
    assert_eq!(deps.get(&vec!["c".to_string()]), None, "a test module is no dependency: {deps:?}");
}
