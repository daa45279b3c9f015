//! `--buffers` files: CSV buffer lists, read row by row with the line and column of any fault.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use graphpool_planner::pipeline::NamedBuffer;

use crate::units::parse_size;

use super::PlanCliError;

/// A parsed `--buffers` file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferList {
    /// The buffers, in file order.
    pub buffers: Vec<NamedBuffer>,
    /// Offsets from an `offset` column (another allocator's placement of the same buffers),
    /// when the file has one.
    pub offsets: Option<Vec<u64>>,
}

/// How to read a `--buffers` file.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CsvOptions {
    /// The `end` column is the last step a buffer is live (`[start, end]`, as traces that
    /// record the last use have it), rather than the first it is not.
    pub inclusive_end: bool,
}

/// A column of a `--buffers` file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Column {
    Buffer,
    Start,
    End,
    Size,
    AliasGroup,
    Offset,
}

impl Column {
    /// The column's name in messages.
    fn name(self) -> &'static str {
        match self {
            Column::Buffer => "buffer",
            Column::Start => "start",
            Column::End => "end",
            Column::Size => "size",
            Column::AliasGroup => "alias_group",
            Column::Offset => "offset",
        }
    }

    /// The column a header name stands for (case-insensitive; MiniMalloc's `id`, `lower`
    /// and `upper` are accepted, `upper` exclusive like `end`).
    fn parse(header: &str) -> Option<Column> {
        Some(match header.to_ascii_lowercase().as_str() {
            "buffer" | "id" | "buffer_id" | "name" => Column::Buffer,
            "start" | "lower" | "begin" => Column::Start,
            "end" | "upper" => Column::End,
            "size" => Column::Size,
            "alias_group" => Column::AliasGroup,
            "offset" => Column::Offset,
            _ => return None,
        })
    }
}

/// Splits one CSV record into `fields` (cleared first; RFC 4180: a field may be quoted, `""`
/// inside quotes is a quote), each trimmed of surrounding blanks. Unquoted fields borrow from
/// `line`, so that a list of a million rows is not a few million small strings. A malformed
/// record gives the position of the field at fault (0-based) and what is wrong.
fn split_record<'a>(line: &'a str, fields: &mut Vec<Cow<'a, str>>) -> Result<(), (usize, String)> {
    const BLANKS: [char; 2] = [' ', '\t'];
    fields.clear();
    let mut rest = line;
    loop {
        rest = rest.trim_start_matches(BLANKS);
        if let Some(quoted) = rest.strip_prefix('"') {
            let mut field = String::new();
            let mut chars = quoted.char_indices();
            rest = loop {
                match chars.next() {
                    Some((k, '"')) if quoted[k + 1..].starts_with('"') => {
                        chars.next();
                        field.push('"');
                    }
                    Some((k, '"')) => break quoted[k + 1..].trim_start_matches(BLANKS),
                    Some((_, c)) => field.push(c),
                    None => return Err((fields.len(), "a quoted field is not closed on its line".into())),
                }
            };
            if !rest.is_empty() && !rest.starts_with(',') {
                return Err((fields.len(), "text after a closing quote; quote the whole field".into()));
            }
            fields.push(Cow::Owned(field));
        } else {
            let end = rest.find(',').unwrap_or(rest.len());
            let field = &rest[..end];
            if field.contains('"') {
                return Err((
                    fields.len(),
                    "a quote inside an unquoted field; quote the field and double the quote".into(),
                ));
            }
            fields.push(Cow::Borrowed(field.trim_end()));
            rest = &rest[end..];
        }
        match rest.strip_prefix(',') {
            Some(after) => rest = after,
            None => return Ok(()),
        }
    }
}

/// Parses a buffer-list CSV (see the module documentation). Errors give the line number
/// and the column at fault.
pub fn parse_buffers_csv(path: &Path, text: &str, opts: CsvOptions) -> Result<BufferList, PlanCliError> {
    let err = |line: usize, field: &str, message: String| PlanCliError::Csv {
        path: path.to_path_buf(),
        line,
        field: field.to_string(),
        message,
    };
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l.trim_end_matches('\r')));
    let (header_line, header) =
        lines.by_ref().find(|(_, l)| !l.trim().is_empty() && !l.trim_start().starts_with('#')).ok_or_else(
            || err(1, "header", "the file is empty; start with the header buffer,start,end,size".into()),
        )?;
    let mut names = Vec::new();
    split_record(header, &mut names).map_err(|(_, m)| err(header_line, "header", m))?;
    let mut columns: Vec<Column> = Vec::with_capacity(names.len());
    for name in &names {
        let column = Column::parse(name).ok_or_else(|| {
            err(
                header_line,
                "header",
                format!(
                    "unknown column {name:?}; the columns are buffer,start,end,size and optionally \
                     alias_group and offset (MiniMalloc's id,lower,upper also read)"
                ),
            )
        })?;
        if columns.contains(&column) {
            return Err(err(header_line, "header", format!("column {:?} appears twice", column.name())));
        }
        columns.push(column);
    }
    for required in [Column::Buffer, Column::Start, Column::End, Column::Size] {
        if !columns.contains(&required) {
            return Err(err(
                header_line,
                "header",
                format!("no {:?} column; the header must name buffer,start,end,size", required.name()),
            ));
        }
    }
    let at = |c: Column| columns.iter().position(|&x| x == c);
    let [buffer_at, start_at, end_at, size_at] =
        [Column::Buffer, Column::Start, Column::End, Column::Size].map(|c| at(c).expect("checked above"));
    let (alias_at, offset_at) = (at(Column::AliasGroup), at(Column::Offset));
    let listed = columns.iter().map(|c| c.name()).collect::<Vec<_>>().join(",");
    // The column at the `k`th field of a line (the last column for fields past it).
    let column_at = |k: usize| columns[k.min(columns.len() - 1)].name();
    // Rows at most: sized once, not grown (and rehashed) a million rows long.
    let rows = text.bytes().filter(|&b| b == b'\n').count() + 1;
    let mut seen: HashMap<Cow<'_, str>, usize> = HashMap::with_capacity(rows);
    let mut buffers = Vec::with_capacity(rows);
    let mut lines_of = Vec::with_capacity(rows);
    let mut offsets = offset_at.map(|_| Vec::new());
    let mut fields = Vec::with_capacity(columns.len());
    for (line, raw) in lines {
        let trimmed = raw.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        split_record(raw, &mut fields).map_err(|(k, m)| err(line, column_at(k), m))?;
        if fields.len() != columns.len() {
            return Err(err(
                line,
                column_at(fields.len()),
                format!(
                    "expected {} comma-separated fields ({listed}), found {}",
                    columns.len(),
                    fields.len()
                ),
            ));
        }
        let name = fields[buffer_at].clone();
        if name.is_empty() {
            return Err(err(line, "buffer", "is empty; give every buffer a name".into()));
        }
        if let Some(first) = seen.insert(name.clone(), line) {
            return Err(err(line, "buffer", format!("duplicate name {name:?} (first on line {first})")));
        }
        let int = |k: usize, column: Column, what: &str| {
            fields[k].parse::<u64>().map_err(|e| {
                let message = if *e.kind() == std::num::IntErrorKind::PosOverflow {
                    format!("{:?} is too large: a {what} is at most 2^64 - 1", fields[k])
                } else {
                    format!("expected a non-negative integer {what}, found {:?}", fields[k])
                };
                err(line, column.name(), message)
            })
        };
        let start = int(start_at, Column::Start, "step")?;
        let last = int(end_at, Column::End, "step")?;
        let end = if opts.inclusive_end {
            last.checked_add(1).ok_or_else(|| {
                err(
                    line,
                    "end",
                    format!(
                        "is {last}, the last step there is: with --inclusive-end the step after it must \
                         exist too; number the steps from 0"
                    ),
                )
            })?
        } else {
            last
        };
        if end <= start {
            let hint = if opts.inclusive_end {
                "buffers live over [start, end] with --inclusive-end"
            } else {
                "buffers live over [start, end); if end is the last step a buffer is live, pass \
                 --inclusive-end"
            };
            return Err(err(line, "end", format!("is {last}, not after start {start}; {hint}")));
        }
        let size = parse_size(&fields[size_at]).map_err(|e| err(line, "size", e.to_string()))?;
        if let (Some(k), Some(list)) = (offset_at, offsets.as_mut()) {
            list.push(int(k, Column::Offset, "byte offset")?);
        }
        buffers.push(NamedBuffer {
            name: name.into_owned(),
            start,
            end,
            size,
            // Blanks alone (quoted) name no group, as an empty field does.
            alias_group: alias_at.map(|k| fields[k].trim().to_string()).unwrap_or_default(),
        });
        lines_of.push(line);
    }
    check_total_size(&buffers).map_err(|(k, total)| {
        err(
            lines_of[k],
            "size",
            format!(
                "is {} bytes, the largest of buffers that add up to {total} bytes, more than the \
                 2^62 the planner places (an alias group counts once, at its largest member); check \
                 the sizes: byte counts, or sizes with a unit such as 64MiB",
                buffers[k].size
            ),
        )
    })?;
    Ok(BufferList { buffers, offsets })
}

/// Whether the buffers add up to no more than the planner places
/// ([`graphpool_planner::MAX_TOTAL_BYTES`]), as it counts them: each buffer once,
/// except that an alias group takes one place, as large as its largest member. Err: the
/// position of the largest buffer (the likeliest mistake), and the sum.
fn check_total_size(buffers: &[NamedBuffer]) -> Result<(), (usize, u128)> {
    let mut groups: HashMap<&str, u64> = HashMap::new();
    let mut total = 0u128;
    for b in buffers {
        if b.alias_group.is_empty() {
            total += b.size as u128;
        } else {
            let largest = groups.entry(&b.alias_group).or_insert(0);
            *largest = (*largest).max(b.size);
        }
    }
    total += groups.values().map(|&s| s as u128).sum::<u128>();
    if total <= graphpool_planner::MAX_TOTAL_BYTES as u128 {
        return Ok(());
    }
    let largest = (0..buffers.len()).max_by_key(|&k| (buffers[k].size, std::cmp::Reverse(k))).unwrap_or(0);
    Err((largest, total))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::plan::GivenPlacement;
    use graphpool_planner::PlaceOptions;
    use graphpool_planner::pipeline;

    fn csv(text: &str) -> Result<Vec<NamedBuffer>, PlanCliError> {
        parse_buffers_csv(Path::new("t.csv"), text, CsvOptions::default()).map(|l| l.buffers)
    }

    fn line_field(e: PlanCliError) -> (usize, String) {
        match e {
            PlanCliError::Csv { line, field, .. } => (line, field),
            other => panic!("not a CSV error: {other}"),
        }
    }

    #[test]
    fn reads_buffers() {
        let b = csv("buffer,start,end,size\n# comment\na,0,4,1024\n\nb, 2, 6, 1MiB\n").unwrap();
        assert_eq!(b.len(), 2);
        assert_eq!(b[1].size, 1 << 20);
        let b = csv("buffer,start,end,size,alias_group\na,0,4,16,g\nb,5,6,16,g\n").unwrap();
        assert_eq!(b[1].alias_group, "g");
        let b = csv("buffer,start,end,size,alias_group\na,0,4,16,\" \"\n").unwrap();
        assert_eq!(b[0].alias_group, "", "a quoted blank is no group");
    }

    #[test]
    fn rejects_malformed_lines_with_line_and_field() {
        let e = csv("buffer,start,end,size\na,18446744073709551616,5,4\n").unwrap_err();
        assert!(e.to_string().contains("too large"), "{e}");
        assert_eq!(line_field(e), (2, "start".into()));
        assert_eq!(line_field(csv("buf,start,end,size\n").unwrap_err()), (1, "header".into()));
        assert_eq!(line_field(csv("buffer,start,end,size\na,0,x,4\n").unwrap_err()), (2, "end".into()));
        assert_eq!(
            line_field(csv("buffer,start,end,size\na,0,4,4\nb,-1,4,4\n").unwrap_err()),
            (3, "start".into())
        );
        assert_eq!(line_field(csv("buffer,start,end,size\na,5,4,4\n").unwrap_err()), (2, "end".into()));
        assert_eq!(line_field(csv("buffer,start,end,size\na,0,4,lots\n").unwrap_err()), (2, "size".into()));
        assert_eq!(line_field(csv("buffer,start,end,size\na,0,4\n").unwrap_err()), (2, "size".into()));
        assert_eq!(
            line_field(csv("buffer,start,end,size\na,0,4,4\na,1,2,3\n").unwrap_err()),
            (3, "buffer".into())
        );
        assert_eq!(line_field(csv("buffer,start,end,size\n,0,4,4\n").unwrap_err()), (2, "buffer".into()));
        assert_eq!(line_field(csv("").unwrap_err()), (1, "header".into()));
        // A quote gone wrong is named by its column, wherever it is.
        assert_eq!(line_field(csv("buffer,start,end,size\na,0,4,\"16\n").unwrap_err()), (2, "size".into()));
        assert_eq!(line_field(csv("buffer,start,end,size\na,0,\"4\"x,16\n").unwrap_err()), (2, "end".into()));
        let e = parse_buffers_csv(
            Path::new("t.csv"),
            "buffer,start,end,size\na,0,18446744073709551615,4\n",
            CsvOptions { inclusive_end: true },
        )
        .unwrap_err();
        assert!(e.to_string().contains("the step after it must exist"), "{e}");
        assert_eq!(line_field(e), (2, "end".into()));
    }

    #[test]
    fn sizes_past_the_arena_name_the_line_of_the_largest() {
        // Two buffers of 10^19 bytes: 2 × 10^19 > 2^62. The planner would only say "the sizes".
        let e =
            csv("buffer,start,end,size\na,0,4,16\nb,0,4,10000000000000000000\nc,0,2,10000000000000000000\n")
                .unwrap_err();
        assert!(e.to_string().starts_with("t.csv:3: field `size`: is 10000000000000000000 bytes"), "{e}");
        assert_eq!(e.line(), Some(3));
        // An alias group takes one place, as large as its largest member: these fit.
        let b = csv(
            "buffer,start,end,size,alias_group\na,0,4,4000000000000000000,g\nb,5,6,4000000000000000000,g\n",
        )
        .unwrap();
        assert_eq!(b.len(), 2);
    }

    #[test]
    fn reads_columns_by_name_in_any_order_and_other_allocators_headers() {
        let b = csv("\u{feff}size,end,start,buffer\r\n64,4,0,a\r\n").unwrap();
        assert_eq!((b[0].name.as_str(), b[0].start, b[0].end, b[0].size), ("a", 0, 4, 64));
        // MiniMalloc's older header: `upper` is exclusive like `end`.
        let b = csv("id,lower,upper,size\nb1,0,3,4\nb2,3,9,4\n").unwrap();
        assert_eq!((b[1].name.as_str(), b[1].start, b[1].end), ("b2", 3, 9));
        let e = csv("buffer,start,end,size,alignment\n").unwrap_err();
        assert_eq!(line_field(e), (1, "header".into()));
        let e = csv("buffer,start,end,size,start\n").unwrap_err();
        assert!(e.to_string().contains("appears twice"), "{e}");
        let e = csv("buffer,start,size\n").unwrap_err();
        assert!(e.to_string().contains("no \"end\" column"), "{e}");
    }

    #[test]
    fn records_split_into_trimmed_fields_borrowed_unless_quoted() {
        let mut f = Vec::new();
        let split = |line: &'static str, f: &mut Vec<Cow<'static, str>>| split_record(line, f);
        split(" a ,\tb\t, \"c, \"\"d\"\"\" ,", &mut f).unwrap();
        assert_eq!(f, ["a", "b", "c, \"d\"", ""]);
        assert!(matches!(f[0], Cow::Borrowed(_)) && matches!(f[2], Cow::Owned(_)));
        split("ünï,\"çödé\",", &mut f).unwrap();
        assert_eq!(f, ["ünï", "çödé", ""], "the vector is cleared first; multibyte text kept");
        split("", &mut f).unwrap();
        assert_eq!(f, [""]);
        assert_eq!(split("a,\"b\" c", &mut f).unwrap_err().0, 1);
        assert_eq!(split("a,b,\"c", &mut f).unwrap_err().0, 2);
        assert_eq!(split("a,b\"c", &mut f).unwrap_err().0, 1);
    }

    #[test]
    fn reads_quoted_fields() {
        let b = csv("buffer,start,end,size\n\"layer.0, \"\"attn\"\"\", 0, 4, \"16\"\n").unwrap();
        assert_eq!(b[0].name, "layer.0, \"attn\"");
        assert_eq!(b[0].size, 16);
        assert_eq!(line_field(csv("buffer,start,end,size\n\"a,0,4,16\n").unwrap_err()), (2, "buffer".into()));
        assert_eq!(
            line_field(csv("buffer,start,end,size\na\"b,0,4,16\n").unwrap_err()),
            (2, "buffer".into())
        );
    }

    #[test]
    fn inclusive_end_reads_the_last_live_step() {
        let text = "buffer,start,end,size\na,0,3,4\nb,3,3,4\n";
        let e = csv(text).unwrap_err();
        assert!(e.to_string().contains("--inclusive-end"), "{e}");
        let list = parse_buffers_csv(Path::new("t.csv"), text, CsvOptions { inclusive_end: true }).unwrap();
        assert_eq!((list.buffers[0].end, list.buffers[1].end), (4, 4));
        // Live together at step 3: they cannot share bytes.
        let plan = pipeline::plan_buffers(&list.buffers, &PlaceOptions::default()).unwrap();
        assert_eq!(plan.lower_bound, 8);
    }

    #[test]
    fn an_offset_column_is_checked_against_the_plan() {
        let text = "buffer,start,end,size,offset\na,0,4,16,0\nb,2,6,16,16\nc,4,8,32,32\n";
        let list = parse_buffers_csv(Path::new("t.csv"), text, CsvOptions::default()).unwrap();
        assert_eq!(list.offsets.as_deref(), Some(&[0, 16, 32][..]));
        let plan = pipeline::plan_buffers(&list.buffers, &PlaceOptions::default()).unwrap();
        let given = GivenPlacement::check(&list.buffers, list.offsets.as_ref().unwrap());
        assert_eq!(given.footprint, Ok(64));
        assert!(given.describe(plan.lower_bound).contains("valid"));
        assert_eq!(given.json(plan.lower_bound)["footprint_bytes"], 64);
        // b and c overlap in memory while both live.
        let given = GivenPlacement::check(&list.buffers, &[0, 16, 20]);
        assert!(
            matches!(&given.footprint, Err(pipeline::PlacementError::Overlap { a, b }) if a == "b" && b == "c")
        );
        assert_eq!(given.json(plan.lower_bound)["valid"], false);
        let e = parse_buffers_csv(
            Path::new("t.csv"),
            "buffer,start,end,size,offset\na,0,4,16,x\n",
            CsvOptions::default(),
        )
        .unwrap_err();
        assert_eq!(line_field(e), (2, "offset".into()));
    }
}
