//! The daemon's layers, checked: every `crate::` and `super::` path in the
//! daemon crate's production code (`crates/daemon/src`) must go to a module
//! that ARCHITECTURE.md's module map lets its layer import, and the top-level
//! modules must not import each other in a circle. The rules live in one
//! place, the map's table (its "may import" column); this test reads it, and
//! also requires the map to name every module file, so that it cannot go
//! stale. Test code (`#[cfg(test)]` items, `tests.rs` files and what they
//! declare) is exempt.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Imports that break the map today and are being removed. Each entry is
/// (importing module, imported module); the test fails when one no longer
/// occurs, so that the entry is deleted with the import.
const BEING_REMOVED: &[(&str, &str)] = &[];

/// One row of the module map.
#[derive(Debug)]
struct Row {
    layer: String,
    /// Top-level modules of the layer.
    modules: BTreeSet<String>,
    /// Everything the row names in backticks outside "may import" (files,
    /// folders): the module files it lists.
    names: BTreeSet<String>,
    /// Modules of other layers it may import; None: any.
    may_import: Option<BTreeSet<String>>,
}

/// A `crate::`/`super::` path of production code that leaves its module.
#[derive(Debug, Clone, PartialEq)]
struct Import {
    /// File, relative to the crate's `src`.
    file: String,
    line: usize,
    /// Top-level module of the file.
    from: String,
    /// Top-level module the path names.
    to: String,
}

fn backticked(s: &str) -> Vec<String> {
    s.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

fn without_parentheses(s: &str) -> String {
    let mut depth = 0;
    s.chars()
        .filter(|&c| {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                _ => return depth == 0,
            }
            false
        })
        .collect()
}

/// The top-level module a listed path (`daemon.rs`, `daemon/queue_move.rs`,
/// `control/`) belongs to.
fn top_module(path: &str) -> String {
    let first = path.split('/').next().unwrap_or(path);
    first.trim_end_matches(".rs").to_string()
}

/// Reads the module map: the first table after the "## Module map" heading.
/// Its columns must include "modules" and "may import".
fn parse_map(md: &str) -> Result<Vec<Row>, String> {
    let start = md
        .find("\n## Module map")
        .ok_or("ARCHITECTURE.md has no \"## Module map\" section")?;
    let lines: Vec<&str> = md[start..]
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .collect();
    let cells = |l: &str| -> Vec<String> {
        l.trim()
            .trim_matches('|')
            .split('|')
            .map(|c| c.trim().to_string())
            .collect()
    };
    let header = cells(lines.first().ok_or("the module map has no table")?);
    let col = |name: &str| {
        header
            .iter()
            .position(|h| h == name)
            .ok_or(format!("the module map has no {name:?} column"))
    };
    let (modules_col, may_col) = (col("modules")?, col("may import")?);
    let mut rows = Vec::new();
    for l in lines.iter().skip(2) {
        let c = cells(l);
        if c.len() != header.len() {
            return Err(format!("module map row with {} cells: {l}", c.len()));
        }
        let modules: BTreeSet<String> = backticked(&c[modules_col])
            .iter()
            .map(|p| top_module(p))
            .collect();
        let names = c
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != may_col)
            .flat_map(|(_, cell)| backticked(cell))
            .collect();
        let may = &c[may_col];
        let may_import = if may == "any module" {
            None
        } else if may == "none" {
            Some(BTreeSet::new())
        } else {
            // Module names in backticks; parentheses say why, and may quote anything.
            let m: BTreeSet<String> = backticked(&without_parentheses(may)).into_iter().collect();
            if m.is_empty() {
                return Err(format!(
                    "{}: \"may import\" must be `modules`, \"none\" or \"any module\"",
                    c[0]
                ));
            }
            Some(m)
        };
        rows.push(Row {
            layer: c[0].clone(),
            modules,
            names,
            may_import,
        });
    }
    Ok(rows)
}

/// Every `.rs` file under `dir`, as a path relative to it with `/`.
fn rust_files(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        for entry in fs::read_dir(dir.join(&rel)).unwrap() {
            let entry = entry.unwrap();
            let path = rel.join(entry.file_name());
            if entry.file_type().unwrap().is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    out.sort();
    out
}

/// The module path of a file: `a/b.rs` and `a/b/mod.rs` are `[a, b]`.
fn module_path(file: &str) -> Vec<String> {
    let mut parts: Vec<String> = file.split('/').map(str::to_string).collect();
    let last = parts.pop().unwrap();
    if last != "mod.rs" && last != "lib.rs" {
        parts.push(last.trim_end_matches(".rs").to_string());
    }
    parts
}

#[derive(Debug, Clone, PartialEq)]
struct Tok {
    text: String,
    line: usize,
}

/// Rust source as identifiers, `::` and single punctuation characters, with
/// comments (doc comments included), string and character literals removed.
fn tokenize(src: &str) -> Vec<Tok> {
    let b = src.as_bytes();
    let (mut i, mut line, mut out) = (0, 1, Vec::new());
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied().unwrap_or(0);
        if c == b'\n' {
            line += 1;
            i += 1;
        } else if c.is_ascii_whitespace() {
            i += 1;
        } else if c == b'/' && next == b'/' {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && next == b'*' {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    line += usize::from(b[i] == b'\n');
                    i += 1;
                }
            }
        } else if (c == b'r' || (c == b'b' && next == b'r')) && {
            let j = i + if c == b'b' { 2 } else { 1 };
            b.get(j) == Some(&b'"')
                || (b.get(j) == Some(&b'#') && !ident(*b.get(j + 1).unwrap_or(&0)))
        } {
            // Raw string: r"...", r#"..."#, br"...".
            i += if c == b'b' { 2 } else { 1 };
            let hashes = b[i..].iter().take_while(|&&h| h == b'#').count();
            i += hashes + 1;
            let end: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            while i < b.len() && !b[i..].starts_with(&end) {
                line += usize::from(b[i] == b'\n');
                i += 1;
            }
            i += end.len();
        } else if c == b'"' || (c == b'b' && next == b'"') {
            i += if c == b'b' { 2 } else { 1 };
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                line += usize::from(b.get(i) == Some(&b'\n'));
                i += 1;
            }
            i += 1;
        } else if c == b'\'' || (c == b'b' && next == b'\'') {
            // A character literal ('x', '\'', 'é', b'x') or a lifetime ('a).
            let j = i + usize::from(c == b'b');
            if b.get(j + 1) == Some(&b'\\') {
                i = j + 3;
                while i < b.len() && b[i] != b'\'' {
                    i += 1;
                }
                i += 1;
            } else if b.get(j + 2) == Some(&b'\'') {
                i = j + 3;
            } else if b.get(j + 1).is_some_and(|&x| x >= 0x80) {
                i = j + 1 + src[j + 1..].find('\'').map_or(0, |k| k + 1);
            } else {
                i = j + 1;
                while i < b.len() && ident(b[i]) {
                    i += 1;
                }
            }
        } else if ident(c) {
            let s = i;
            while i < b.len() && (ident(b[i]) || (b[i] == b'#' && &b[s..i] == b"r")) {
                i += 1;
            }
            let text = src[s..i].trim_start_matches("r#").to_string();
            out.push(Tok { text, line });
        } else if c == b':' && next == b':' {
            out.push(Tok {
                text: "::".into(),
                line,
            });
            i += 2;
        } else {
            let ch = src[i..].chars().next().unwrap();
            out.push(Tok {
                text: ch.to_string(),
                line,
            });
            i += ch.len_utf8();
        }
    }
    out
}

/// What one file says about layers: the paths leaving its module (target
/// = top-level module named, for paths that reach the crate root), and the
/// modules it declares under `#[cfg(test)]`.
#[derive(Debug, Default, PartialEq)]
struct Scan {
    /// (line, top-level module named).
    paths: Vec<(usize, String)>,
    test_mods: Vec<String>,
    /// The whole file is test code (`#![cfg(test)]`).
    test_file: bool,
}

fn is_test_cfg(attr: &[Tok]) -> bool {
    let t: Vec<&str> = attr.iter().map(|t| t.text.as_str()).collect();
    t.first() == Some(&"cfg") && t.contains(&"test") && !t.contains(&"not")
}

/// Index just past the item starting at `i` (its `;` or its `{...}`).
fn skip_item(t: &[Tok], mut i: usize) -> usize {
    let mut depth = 0i32;
    while i < t.len() {
        match t[i].text.as_str() {
            "(" | "[" => depth += 1,
            ")" | "]" => depth -= 1,
            "{" => depth += 1,
            "}" => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            ";" if depth == 0 => return i + 1,
            _ => {}
        }
        i += 1;
    }
    i
}

/// Index of the `]` closing the attribute whose `[` is at `i`.
fn attr_end(t: &[Tok], i: usize) -> usize {
    let mut depth = 0;
    for (k, tok) in t.iter().enumerate().skip(i) {
        match tok.text.as_str() {
            "[" => depth += 1,
            "]" => {
                depth -= 1;
                if depth == 0 {
                    return k;
                }
            }
            _ => {}
        }
    }
    t.len()
}

fn scan(file: &str, src: &str) -> Scan {
    let t = tokenize(src);
    let file_mod = module_path(file);
    let mut out = Scan::default();
    // Inline modules open around the current token: (name, brace depth inside).
    let mut inline: Vec<(String, i32)> = Vec::new();
    let mut depth = 0i32;
    let mut i = 0;
    let txt = |k: usize| t.get(k).map_or("", |x: &Tok| x.text.as_str());
    while i < t.len() {
        match txt(i) {
            "#" if txt(i + 1) == "!" && txt(i + 2) == "[" => {
                let end = attr_end(&t, i + 2);
                if is_test_cfg(&t[i + 3..end]) {
                    out.test_file = true;
                    return out;
                }
                i = end + 1;
                continue;
            }
            "#" if txt(i + 1) == "[" => {
                let end = attr_end(&t, i + 1);
                if is_test_cfg(&t[i + 2..end]) {
                    // Skip further attributes, then the item.
                    let mut k = end + 1;
                    while txt(k) == "#" && txt(k + 1) == "[" {
                        k = attr_end(&t, k + 1) + 1;
                    }
                    let item = skip_item(&t, k);
                    let words: Vec<&str> = (k..item).map(txt).collect();
                    if let Some(p) = words.iter().position(|w| *w == "mod") {
                        if words.last() == Some(&";") {
                            out.test_mods.push(words[p + 1].to_string());
                        }
                    }
                    i = item;
                } else {
                    i = end + 1;
                }
                continue;
            }
            "{" => depth += 1,
            "}" => {
                depth -= 1;
                if inline.last().is_some_and(|(_, d)| *d > depth) {
                    inline.pop();
                }
            }
            "mod" if txt(i + 2) == "{" => {
                inline.push((txt(i + 1).to_string(), depth + 1));
            }
            "crate" if txt(i + 1) == "::" && (i == 0 || txt(i - 1) != "$") => {
                out.paths.extend(first_segments(&t, i + 2));
            }
            "super" if txt(i + 1) == "::" && (i == 0 || txt(i - 1) != "::") => {
                let mut k = i;
                let mut up = 0;
                while txt(k) == "super" && txt(k + 1) == "::" {
                    up += 1;
                    k += 2;
                }
                let mut here = file_mod.clone();
                here.extend(inline.iter().map(|(n, _)| n.clone()));
                if up >= here.len() {
                    out.paths.extend(first_segments(&t, k));
                }
                i = k;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// The first segment(s) of the path whose remainder starts at `i`: one
/// identifier, or each item of a `{a, b::c}` group.
fn first_segments(t: &[Tok], i: usize) -> Vec<(usize, String)> {
    let Some(tok) = t.get(i) else {
        return Vec::new();
    };
    if tok.text != "{" {
        let is_ident = tok
            .text
            .starts_with(|c: char| c.is_alphanumeric() || c == '_');
        return if is_ident && tok.text != "self" {
            vec![(tok.line, tok.text.clone())]
        } else {
            Vec::new()
        };
    }
    let (mut out, mut depth, mut at_item) = (Vec::new(), 0, true);
    for tok in &t[i..] {
        match tok.text.as_str() {
            "{" => {
                depth += 1;
                if depth > 1 {
                    at_item = false;
                }
            }
            "}" => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            "," if depth == 1 => at_item = true,
            "self" | "*" => at_item = false,
            w if at_item && depth == 1 => {
                out.push((tok.line, w.to_string()));
                at_item = false;
            }
            _ => {}
        }
    }
    out
}

/// The production files and their imports of other top-level modules.
struct Tree {
    /// Production files (relative to `src`), without `lib.rs`.
    files: Vec<String>,
    /// Top-level modules.
    modules: BTreeSet<String>,
    imports: Vec<Import>,
}

fn read_tree(src_dir: &Path) -> Tree {
    let all = rust_files(src_dir);
    let scans: BTreeMap<String, Scan> = all
        .iter()
        .map(|f| {
            (
                f.clone(),
                scan(f, &fs::read_to_string(src_dir.join(f)).unwrap()),
            )
        })
        .collect();
    // Test modules: by name, and whatever a `#[cfg(test)] mod x;` declares.
    let mut test_prefixes: Vec<String> = Vec::new();
    for (f, s) in &scans {
        let dir = module_path(f).join("/");
        for m in &s.test_mods {
            test_prefixes.push(if dir.is_empty() {
                m.clone()
            } else {
                format!("{dir}/{m}")
            });
        }
    }
    let is_test = |f: &str| {
        f.ends_with("/tests.rs")
            || f.contains("/tests/")
            || scans[f].test_file
            || test_prefixes
                .iter()
                .any(|p| f == format!("{p}.rs") || f.starts_with(&format!("{p}/")))
    };
    let files: Vec<String> = all
        .iter()
        .filter(|f| *f != "lib.rs" && !is_test(f))
        .cloned()
        .collect();
    let modules: BTreeSet<String> = files.iter().map(|f| top_module(f)).collect();
    let mut imports = Vec::new();
    for f in &files {
        let from = top_module(f);
        for (line, to) in &scans[f].paths {
            if *to != from && modules.contains(to) {
                imports.push(Import {
                    file: f.clone(),
                    line: *line,
                    from: from.clone(),
                    to: to.clone(),
                });
            }
        }
    }
    Tree {
        files,
        modules,
        imports,
    }
}

/// The names the module map may give file `f`: `a/b/c.rs` is `a/b/c.rs`,
/// `b/c.rs` or `c.rs`; a `mod.rs` also its folder (`a/b/`, `b/`), and only
/// a top-level folder's `mod.rs` is plain `mod.rs`.
fn names_of(f: &str) -> Vec<String> {
    let parts: Vec<&str> = f.split('/').collect();
    let mut names: Vec<String> = (0..parts.len()).map(|k| parts[k..].join("/")).collect();
    if parts.last() == Some(&"mod.rs") {
        let dir = &parts[..parts.len() - 1];
        names.extend((0..dir.len()).map(|k| format!("{}/", dir[k..].join("/"))));
        if parts.len() > 2 {
            names.retain(|n| n != "mod.rs");
        }
    }
    names
}

/// Everything wrong with `tree` against `rows`, one line each.
fn check(tree: &Tree, rows: &[Row], being_removed: &[(&str, &str)]) -> Vec<String> {
    let mut errors = Vec::new();
    let mut row_of: BTreeMap<&str, &Row> = BTreeMap::new();
    for r in rows {
        for m in &r.modules {
            if row_of.insert(m, r).is_some() {
                errors.push(format!("module map: `{m}` is in two layers"));
            }
            if !tree.modules.contains(m) {
                errors.push(format!(
                    "module map: layer {} lists `{m}`, which does not exist",
                    r.layer
                ));
            }
        }
        for m in r.may_import.iter().flatten() {
            if !tree.modules.contains(m) {
                errors.push(format!(
                    "module map: layer {} may import `{m}`, which does not exist",
                    r.layer
                ));
            }
        }
    }
    for f in &tree.files {
        let Some(r) = row_of.get(top_module(f).as_str()) else {
            errors.push(format!(
                "module map: no layer lists `{}` ({f})",
                top_module(f)
            ));
            continue;
        };
        let names = names_of(f);
        if !names.iter().any(|n| r.names.contains(n)) {
            errors.push(format!("module map: layer {} does not name {f}", r.layer));
        }
    }
    // And every file the map names is still there.
    for r in rows {
        for n in r
            .names
            .iter()
            .filter(|n| n.ends_with(".rs") || n.ends_with('/'))
        {
            if n.starts_with("examples/") || n.starts_with("tests/") {
                continue;
            }
            let exists = tree
                .files
                .iter()
                .filter(|f| r.modules.contains(&top_module(f)))
                .any(|f| names_of(f).contains(n));
            if !exists {
                errors.push(format!(
                    "module map: layer {} names `{n}`, which is no module file of the layer",
                    r.layer
                ));
            }
        }
    }
    let excused = |i: &Import| being_removed.contains(&(i.from.as_str(), i.to.as_str()));
    for i in &tree.imports {
        let (Some(from), Some(to)) = (row_of.get(i.from.as_str()), row_of.get(i.to.as_str()))
        else {
            continue;
        };
        let allowed = from.may_import.as_ref().is_none_or(|m| m.contains(&i.to))
            || from.modules.contains(&i.to);
        if !allowed && !excused(i) {
            errors.push(format!(
                "{}:{}: imports `crate::{}` ({}), which layer {} may not import",
                i.file, i.line, i.to, to.layer, from.layer
            ));
        }
    }
    for (from, to) in being_removed {
        if !tree.imports.iter().any(|i| i.from == *from && i.to == *to) {
            errors.push(format!(
                "`{from}` no longer imports `{to}`: delete the entry from BEING_REMOVED"
            ));
        }
    }
    let edges: Vec<&Import> = tree.imports.iter().filter(|i| !excused(i)).collect();
    for cycle in cycles(&edges) {
        let steps: Vec<String> = cycle
            .windows(2)
            .map(|w| {
                let i = edges
                    .iter()
                    .find(|i| i.from == w[0] && i.to == w[1])
                    .unwrap();
                format!("{} -> {} ({}:{})", w[0], w[1], i.file, i.line)
            })
            .collect();
        errors.push(format!("import circle: {}", steps.join(", ")));
    }
    errors
}

/// One circle per strongly connected group of modules, as a closed path
/// (first == last).
fn cycles(edges: &[&Import]) -> Vec<Vec<String>> {
    let mut graph: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for e in edges {
        graph.entry(&e.from).or_default().insert(&e.to);
    }
    let reaches = |a: &str, b: &str| {
        let (mut seen, mut stack) = (BTreeSet::new(), vec![a]);
        while let Some(n) = stack.pop() {
            for &m in graph.get(n).into_iter().flatten() {
                if m == b {
                    return true;
                }
                if seen.insert(m) {
                    stack.push(m);
                }
            }
        }
        false
    };
    let mut reported: BTreeSet<&str> = BTreeSet::new();
    let mut out = Vec::new();
    for &start in graph.keys() {
        if reported.contains(start) || !reaches(start, start) {
            continue;
        }
        // Shortest path back to `start` (breadth first), for the report.
        let mut prev: BTreeMap<&str, &str> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([start]);
        'search: while let Some(n) = queue.pop_front() {
            for &m in graph.get(n).into_iter().flatten() {
                if m == start {
                    let mut path = vec![start.to_string(), n.to_string()];
                    let mut k = n;
                    while k != start {
                        k = prev[k];
                        path.push(k.to_string());
                    }
                    path.reverse();
                    path.dedup();
                    if path.first() != path.last() {
                        path.push(start.to_string());
                    }
                    out.push(path);
                    break 'search;
                }
                if m != start && !prev.contains_key(m) {
                    prev.insert(m, n);
                    queue.push_back(m);
                }
            }
        }
        reported.extend(
            graph
                .keys()
                .copied()
                .filter(|&m| reaches(start, m) && reaches(m, start)),
        );
        reported.insert(start);
    }
    out
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn the_daemon_keeps_the_layers_of_architecture_md() {
    let md = fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    let rows = parse_map(&md).unwrap_or_else(|e| panic!("{e}"));
    let tree = read_tree(&root().join("crates/daemon/src"));
    assert!(tree.imports.len() > 20, "the scan found almost no imports");
    let errors = check(&tree, &rows, BEING_REMOVED);
    assert!(
        errors.is_empty(),
        "the daemon's imports break ARCHITECTURE.md's module map:\n{}",
        errors.join("\n")
    );
}

// The checker itself, on small inputs.

fn paths(file: &str, src: &str) -> Vec<String> {
    scan(file, src).paths.into_iter().map(|(_, m)| m).collect()
}

#[test]
fn comments_strings_and_test_code_are_not_imports() {
    let src = r##"
        //! [`x`]: crate::doc_link
        // use crate::commented;
        /* crate::block /* nested */ crate::comment */
        const S: &str = "crate::string";
        const R: &str = r#"crate::raw"#;
        const C: char = '"';
        fn f<'a>(x: &'a u8) -> char { 'x' }
        #[cfg(test)]
        mod tests {
            use crate::in_tests;
        }
        #[cfg(test)]
        mod helpers;
        #[cfg(not(test))]
        use crate::production;
        use crate::real;
    "##;
    let s = scan("m.rs", src);
    assert_eq!(
        s.paths,
        vec![(16, "production".into()), (17, "real".into())]
    );
    assert_eq!(s.test_mods, vec!["helpers".to_string()]);
    assert!(scan("m.rs", "#![cfg(test)]\nuse crate::x;").test_file);
}

#[test]
fn groups_and_super_paths_are_resolved() {
    assert_eq!(
        paths("a/b.rs", "use crate::{x::{Y, Z}, w, self};"),
        vec!["x", "w"]
    );
    // In `a/b.rs`, `super::` is `a`; `super::super::` the crate root.
    assert_eq!(
        paths("a/b.rs", "use super::sib; use super::super::v;"),
        vec!["v"]
    );
    // In `a.rs` or `a/mod.rs`, `super::` is the crate root.
    assert_eq!(paths("a.rs", "use super::v;"), vec!["v"]);
    assert_eq!(paths("a/mod.rs", "use super::{v, w};"), vec!["v", "w"]);
    // Inside an inline module, one more level.
    assert_eq!(
        paths("a.rs", "mod inner { use super::same; }"),
        Vec::<String>::new()
    );
    assert_eq!(
        paths("a.rs", "fn f() { crate::v::g(); } pub(crate) fn h() {}"),
        vec!["v"]
    );
}

fn tiny_map(may_import_of_low: &str) -> Vec<Row> {
    let md = format!(
        "# x\n\n## Module map\n\n| layer | modules | owns | may import |\n|---|---|---|---|\n\
         | high | `high.rs` | the top | any module |\n\
         | low | `low/` | `mod.rs`, `part.rs` | {may_import_of_low} |\n"
    );
    parse_map(&md).unwrap()
}

fn tiny_tree(imports: &[(&str, &str)]) -> Tree {
    Tree {
        files: vec!["high.rs".into(), "low/mod.rs".into(), "low/part.rs".into()],
        modules: ["high", "low"].iter().map(|s| s.to_string()).collect(),
        imports: imports
            .iter()
            .map(|(from, to)| Import {
                file: format!("{from}.rs"),
                line: 1,
                from: from.to_string(),
                to: to.to_string(),
            })
            .collect(),
    }
}

#[test]
fn a_forbidden_import_a_circle_and_an_unlisted_file_fail() {
    assert!(check(&tiny_tree(&[("high", "low")]), &tiny_map("none"), &[]).is_empty());
    let e = check(&tiny_tree(&[("low", "high")]), &tiny_map("none"), &[]);
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(e[0].starts_with("low.rs:1: imports `crate::high`"), "{e:?}");
    let e = check(
        &tiny_tree(&[("high", "low"), ("low", "high")]),
        &tiny_map("`high`"),
        &[],
    );
    assert_eq!(
        e,
        vec!["import circle: high -> low (high.rs:1), low -> high (low.rs:1)"]
    );
    // An excused import is not reported; an excuse that no longer applies is.
    assert!(check(
        &tiny_tree(&[("low", "high")]),
        &tiny_map("none"),
        &[("low", "high")]
    )
    .is_empty());
    let e = check(&tiny_tree(&[]), &tiny_map("none"), &[("low", "high")]);
    assert_eq!(e.len(), 1, "{e:?}");
    let mut tree = tiny_tree(&[]);
    tree.files.push("low/new.rs".into());
    let e = check(&tree, &tiny_map("none"), &[]);
    assert_eq!(e, vec!["module map: layer low does not name low/new.rs"]);
    let mut tree = tiny_tree(&[]);
    tree.files.retain(|f| f != "low/part.rs");
    let e = check(&tree, &tiny_map("none"), &[]);
    assert_eq!(
        e,
        vec!["module map: layer low names `part.rs`, which is no module file of the layer"]
    );
}
