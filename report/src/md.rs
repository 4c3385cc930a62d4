//! Markdown pipe tables and number formatting.
//!
//! [`Table`] always renders a valid GitHub-flavoured pipe table: a header row, a separator
//! row, and body rows with exactly as many cells as the header (short rows are padded,
//! `|` in a cell is escaped, line breaks become spaces).

/// Column alignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    /// Left-aligned (text).
    Left,
    /// Right-aligned (numbers).
    Right,
}

/// A pipe table under construction.
#[derive(Debug, Clone)]
pub struct Table {
    header: Vec<String>,
    align: Vec<Align>,
    rows: Vec<Vec<String>>,
}

fn cell(s: &str) -> String {
    let s = s.replace(['\n', '\r'], " ").replace('|', "\\|");
    let s = s.trim();
    if s.is_empty() {
        " ".into()
    } else {
        s.to_owned()
    }
}

impl Table {
    /// A table with these column headings; the first column is left-aligned, the others
    /// right-aligned (override with [`Table::align`]).
    pub fn new<S: AsRef<str>>(header: &[S]) -> Self {
        let header: Vec<String> = header.iter().map(|h| h.as_ref().to_owned()).collect();
        let align = (0..header.len())
            .map(|i| if i == 0 { Align::Left } else { Align::Right })
            .collect();
        Table {
            header,
            align,
            rows: Vec::new(),
        }
    }

    /// Sets one column's alignment.
    pub fn align(mut self, col: usize, a: Align) -> Self {
        if let Some(x) = self.align.get_mut(col) {
            *x = a;
        }
        self
    }

    /// Appends a row; missing cells are left blank, extra cells are dropped.
    pub fn row<S: AsRef<str>>(&mut self, cells: &[S]) {
        let mut r: Vec<String> = cells
            .iter()
            .take(self.header.len())
            .map(|c| c.as_ref().to_owned())
            .collect();
        r.resize(self.header.len(), String::new());
        self.rows.push(r);
    }

    /// Whether the table has no body rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Renders the table, one line per row, ending in a newline.
    pub fn render(&self) -> String {
        let line = |cells: &[String]| {
            let mut s = String::from("|");
            for c in cells {
                s.push(' ');
                s.push_str(&cell(c));
                s.push_str(" |");
            }
            s.push('\n');
            s
        };
        let mut out = line(&self.header);
        out.push('|');
        for a in &self.align {
            out.push_str(match a {
                Align::Left => " :--- |",
                Align::Right => " ---: |",
            });
        }
        out.push('\n');
        for r in &self.rows {
            out.push_str(&line(r));
        }
        out
    }
}

/// Seconds as milliseconds with 3 significant-ish digits (`12.3`, `0.456`).
pub fn ms(s: f64) -> String {
    sig(s * 1e3)
}

/// A number with about three significant digits, without exponent for everyday sizes;
/// `NaN`, `∞` or `−∞` for a value that is not finite (a diverged loss is shown as such,
/// not hidden).
pub fn sig(v: f64) -> String {
    if v.is_nan() {
        return "NaN".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "∞" } else { "−∞" }.into();
    }
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else if a >= 0.001 {
        format!("{v:.3}")
    } else {
        format!("{v:.2e}")
    }
}

/// An axis tick: like [`sig`] without trailing zeros (`0.5`, `16`, `2.25`).
pub fn tick(v: f64) -> String {
    let s = sig(v);
    if s.contains('.') && !s.contains('e') {
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        s
    }
}

/// Bytes with a decimal unit (`2.14 MB`).
pub fn bytes(b: f64) -> String {
    if !b.is_finite() {
        return "–".into();
    }
    let units = ["B", "kB", "MB", "GB", "TB"];
    let mut v = b;
    let mut u = 0;
    while v.abs() >= 1000.0 && u + 1 < units.len() {
        v /= 1000.0;
        u += 1;
    }
    if u == 0 {
        format!("{v:.0} B")
    } else {
        format!("{} {}", sig(v), units[u])
    }
}

/// A speed-up factor (`2.31×`).
pub fn factor(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.2}×")
    } else {
        "–".into()
    }
}

/// Each rank's share of `counts` (steps per rank), largest first, ties by rank: `"rank 1 63 %,
/// rank 0 37 %"`; at most four named, then how many ranks more. `None` when every count is
/// zero. Used for the rank the others waited for, by the report and by `dtrain run`.
pub fn rank_shares(counts: &[u64]) -> Option<String> {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return None;
    }
    let mut by: Vec<(usize, u64)> = counts.iter().copied().enumerate().collect();
    by.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut parts: Vec<String> = by
        .iter()
        .take(4)
        .map(|&(r, n)| format!("rank {r} {:.0} %", 100.0 * n as f64 / total as f64))
        .collect();
    if by.len() > 4 {
        parts.push(format!("{} more", by.len() - 4));
    }
    Some(parts.join(", "))
}

/// Checks that `md` holds only well-formed pipe tables: every table has a header row, a
/// separator row of `---` cells and body rows, all with the same number of cells. Returns
/// the number of tables, or the 1-based line of the first problem. Used by the tests and
/// available to callers that post-process reports.
pub fn check_tables(md: &str) -> Result<usize, String> {
    fn cells(line: &str) -> Option<usize> {
        let t = line.trim();
        if !(t.starts_with('|') && t.ends_with('|') && t.len() >= 2) {
            return None;
        }
        let inner = &t[1..t.len() - 1];
        let mut n = 1;
        let mut escaped = false;
        for c in inner.chars() {
            match c {
                '\\' if !escaped => {
                    escaped = true;
                    continue;
                }
                '|' if !escaped => n += 1,
                _ => {}
            }
            escaped = false;
        }
        Some(n)
    }
    let lines: Vec<&str> = md.lines().collect();
    let mut i = 0;
    let mut tables = 0;
    while i < lines.len() {
        let Some(n) = cells(lines[i]) else {
            i += 1;
            continue;
        };
        let sep = lines
            .get(i + 1)
            .ok_or_else(|| format!("line {}: table header without separator", i + 1))?;
        let sep_ok = cells(sep) == Some(n)
            && sep.trim().trim_matches('|').split('|').all(|c| {
                let c = c.trim();
                c.len() >= 3 && c.trim_matches(':').chars().all(|ch| ch == '-')
            });
        if !sep_ok {
            return Err(format!("line {}: bad separator row for {n} columns", i + 2));
        }
        let mut j = i + 2;
        while j < lines.len() {
            match cells(lines[j]) {
                Some(m) if m == n => j += 1,
                Some(m) => {
                    return Err(format!("line {}: {m} cells, header has {n}", j + 1));
                }
                None => break,
            }
        }
        tables += 1;
        i = j;
    }
    Ok(tables)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_render_valid() {
        let mut t = Table::new(&["run", "a", "b"]);
        t.row(&["x|y", "1"]);
        t.row(&["z", "2", "3", "dropped"]);
        let md = t.render();
        assert_eq!(check_tables(&md), Ok(1), "{md}");
        assert!(md.contains("x\\|y"));
        assert!(check_tables("| a | b |\n| --- | --- |\n| 1 |\n").is_err());
        assert!(check_tables("| a | b |\n| 1 | 2 |\n").is_err());
        assert_eq!(check_tables("no tables\n"), Ok(0));
    }

    #[test]
    fn numbers() {
        assert_eq!(sig(1234.4), "1234");
        assert_eq!(sig(12.345), "12.3");
        assert_eq!(sig(0.01234), "0.012");
        assert_eq!(ms(0.007036), "7.04");
        assert_eq!(bytes(2143436.0), "2.14 MB");
        assert_eq!(bytes(999.0), "999 B");
        assert_eq!(factor(2.0), "2.00×");
        assert_eq!(tick(0.5), "0.5");
        assert_eq!(tick(16.0), "16");
        assert_eq!(tick(100.0), "100");
        assert_eq!(tick(0.0), "0");
        assert_eq!(factor(f64::NAN), "–");
    }
}
