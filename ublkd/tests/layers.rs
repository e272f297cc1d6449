//! The crate's module graph, read from its source files: every module's references to
//! other modules of the crate (`use crate::..`, `crate::..` paths, `super::..`, a parent's
//! `child::..`), outside unit tests (`#[cfg(test)] mod tests`, or a `tests.rs`). The graph must have no cycle (no module
//! imports one that imports it back, directly or through others), and every module must
//! sit in a layer and import only from its own layer or those below (docs/ublkd.md opens
//! with the picture).
//!
//! Run alone: `cargo test --test layers -- --nocapture` prints the graph.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Bottom first. A module belongs to the first layer with a prefix of its path
/// (`store` holds `store::remote::http`); the crate root is `main`.
const LAYERS: &[(&str, &[&str])] = &[
    (
        "util: atomic files, timing, kernel plumbing, counters, worker pools",
        &["util", "plumbing", "stats", "pool"],
    ),
    (
        "formats: digest, manifest, blockmap, trace, block form, crc32c",
        &["format"],
    ),
    (
        "typed state: modes, phases, frontends; run-dir state; command line",
        &["types", "state", "args"],
    ),
    (
        "stores: local bundles and packs, remote http/oci, disk cache",
        &["store"],
    ),
    ("verification: the verified chunk store", &["verify"]),
    ("device 2: the read path, prefetch", &["device"]),
    ("frontends: ublk, fuse", &["frontend"]),
    ("server: `ublkd serve`, its supervisor", &["server", "supervisor"]),
    ("control verbs: mount, umount, status, recover, record", &["verbs"]),
    ("entry point", &["main"]),
];

type Graph = BTreeMap<String, BTreeSet<String>>;

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// src/a/b.rs -> "a::b", src/a/mod.rs -> "a", src/main.rs -> "main".
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel.iter().map(|s| s.to_string_lossy().into_owned()).collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts.join("::")
}

/// The code a module runs with: no unit tests, no comment lines.
fn code_of(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    while let Some(l) = lines.next() {
        let t = l.trim();
        if t == "#[cfg(test)]" {
            if let Some(next) = lines.peek() {
                let n = next.trim();
                if n.starts_with("mod tests") || n.starts_with("pub mod tests") {
                    break; // unit tests sit at the end of a file
                }
            }
        }
        if t.starts_with("//") {
            continue;
        }
        out.push_str(l);
        out.push('\n');
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Paths of a use tree / path expression starting at `s` (after `crate::` etc.):
/// `a::b::{c, d::{e, self}}` -> [a,b,c] [a,b,d,e] [a,b,d].
fn paths_at(s: &[char], i: &mut usize) -> Vec<Vec<String>> {
    let skip_ws = |i: &mut usize| {
        while *i < s.len() && s[*i].is_whitespace() {
            *i += 1;
        }
    };
    let mut prefix: Vec<String> = Vec::new();
    loop {
        skip_ws(i);
        if *i < s.len() && s[*i] == '{' {
            *i += 1;
            let mut out = Vec::new();
            loop {
                skip_ws(i);
                if *i >= s.len() {
                    return out;
                }
                if s[*i] == '}' {
                    *i += 1;
                    return out;
                }
                if s[*i] == ',' {
                    *i += 1;
                    continue;
                }
                let before = *i;
                for tail in paths_at(s, i) {
                    let mut p = prefix.clone();
                    p.extend(tail.into_iter().filter(|x| x != "self"));
                    out.push(p);
                }
                // skip `as name` and anything else up to the next separator
                while *i < s.len() && s[*i] != ',' && s[*i] != '}' {
                    *i += 1;
                }
                if *i == before {
                    *i += 1;
                }
            }
        }
        let start = *i;
        while *i < s.len() && is_ident(s[*i]) {
            *i += 1;
        }
        if *i == start {
            return vec![prefix];
        }
        prefix.push(s[start..*i].iter().collect());
        if s.get(*i) == Some(&':') && s.get(*i + 1) == Some(&':') {
            *i += 2;
        } else {
            return vec![prefix];
        }
    }
}

/// The longest module of `modules` that `path` (absolute, crate-relative) names.
fn resolve(modules: &BTreeSet<String>, path: &[String]) -> String {
    for n in (1..=path.len()).rev() {
        let m = path[..n].join("::");
        if modules.contains(&m) {
            return m;
        }
    }
    "main".to_string() // an item of the crate root
}

fn graph() -> Graph {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rs_files(&src, &mut files);
    // unit tests kept in a file of their own (`mod tests;`) are test code too
    files.retain(|f| f.file_stem().is_none_or(|s| s != "tests"));
    let modules: BTreeSet<String> = files.iter().map(|f| module_of(&src, f)).collect();
    let mut g = Graph::new();
    for f in &files {
        let me = module_of(&src, f);
        // the path `super::` and a bare child name start from
        let here: Vec<String> = if me == "main" {
            Vec::new()
        } else {
            me.split("::").map(String::from).collect()
        };
        let code: Vec<char> = code_of(&std::fs::read_to_string(f).unwrap()).chars().collect();
        let mut deps = BTreeSet::new();
        let mut i = 0;
        while i < code.len() {
            if i > 0 && (is_ident(code[i - 1]) || code[i - 1] == ':') {
                i += 1;
                continue;
            }
            let rest: String = code[i..code.len().min(i + 64)].iter().collect();
            let (mut base, skip) = if rest.starts_with("crate::") {
                (Vec::new(), 7)
            } else if rest.starts_with("super::") || rest.starts_with("self::") {
                (here.clone(), 0)
            } else {
                // a child module named without a prefix (`http::get`, `use oci::Reference`)
                let word: String = rest.chars().take_while(|&c| is_ident(c)).collect();
                let child = [here.clone(), vec![word.clone()]].concat().join("::");
                if !word.is_empty() && rest[word.len()..].starts_with("::") && modules.contains(&child) {
                    (here.clone(), 0)
                } else {
                    i += 1;
                    continue;
                }
            };
            i += skip;
            // leading super:: / self::
            loop {
                let r: String = code[i..code.len().min(i + 8)].iter().collect();
                if r.starts_with("super::") {
                    base.pop();
                    i += 7;
                } else if r.starts_with("self::") {
                    i += 6;
                } else {
                    break;
                }
            }
            for p in paths_at(&code, &mut i) {
                let full = [base.clone(), p].concat();
                let m = resolve(&modules, &full);
                if m != me {
                    deps.insert(m);
                }
            }
        }
        g.insert(me, deps);
    }
    g
}

/// Strongly connected components with more than one module (Tarjan).
fn cycles(g: &Graph) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a Graph,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let n = t.index.len();
        t.index.insert(v, n);
        t.low.insert(v, n);
        t.stack.push(v);
        t.on.insert(v);
        for w in t.g.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !t.index.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if t.on.contains(w) {
                let iw = t.index[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|(_, prefixes)| {
        prefixes
            .iter()
            .any(|p| module == *p || module.starts_with(&format!("{p}::")))
    })
}

#[test]
fn module_graph_has_no_cycle() {
    let g = graph();
    for (m, deps) in &g {
        println!("{m} -> {}", deps.iter().cloned().collect::<Vec<_>>().join(", "));
    }
    let c = cycles(&g);
    assert!(
        c.is_empty(),
        "import cycles (each group imports itself back through its members):\n{}",
        c.iter().map(|x| x.join(" <-> ")).collect::<Vec<_>>().join("\n")
    );
}

#[test]
fn modules_import_only_their_layer_or_below() {
    let g = graph();
    let mut bad = Vec::new();
    for (m, deps) in &g {
        let Some(lm) = layer_of(m) else {
            bad.push(format!("{m}: in no layer"));
            continue;
        };
        for d in deps {
            match layer_of(d) {
                Some(ld) if ld <= lm => {}
                Some(ld) => bad.push(format!("{m} ({}) imports {d} ({})", LAYERS[lm].0, LAYERS[ld].0)),
                None => bad.push(format!("{m} imports {d}, which is in no layer")),
            }
        }
    }
    assert!(bad.is_empty(), "layering broken:\n{}", bad.join("\n"));
}

#[test]
fn the_checker_sees_a_cycle() {
    let mut g = Graph::new();
    g.insert("a".into(), ["b".to_string()].into());
    g.insert("b".into(), ["c".to_string()].into());
    g.insert("c".into(), ["a".to_string()].into());
    g.insert("d".into(), ["a".to_string()].into());
    assert_eq!(cycles(&g), vec![vec!["a".to_string(), "b".into(), "c".into()]]);
    let s: Vec<char> = "a::{b, c::{self, d}} as x;".chars().collect();
    let mut i = 0;
    let p = paths_at(&s, &mut i);
    assert_eq!(p, vec![vec!["a", "b"], vec!["a", "c"], vec!["a", "c", "d"]]);
}
