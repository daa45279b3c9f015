//! Arbitrary bytes decoded as `PlanInput` and planned by `graphpool::planning::plan`, as
//! PlanCapture does. No panic; an error names the field; a plan of a buffer list places
//! every buffer inside the footprint and never overlaps two buffers that live at once
//! (unless they share an alias group).
#![no_main]

use std::time::Duration;

use graphpool_proto::v1 as pb;
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let Ok(mut input) = pb::PlanInput::decode(data) else { return };
    input.time_budget_ms = input.time_budget_ms.clamp(1, 2);
    match graphpool::planning::plan(&input, Duration::from_millis(1), 64, 1) {
        Err(e) => assert!(e.field().is_some_and(|f| !f.is_empty()), "error without a field: {e}"),
        Ok(plan) => {
            assert!(plan.footprint_bytes >= plan.lower_bound_bytes, "{plan:?}");
            if let Some(pb::plan_input::Input::Buffers(_)) = &input.input {
                let bs = &plan.buffers;
                for b in bs {
                    assert!(
                        b.offset.checked_add(b.size_bytes).is_some_and(|e| e <= plan.footprint_bytes),
                        "{b:?}"
                    );
                }
                for (i, a) in bs.iter().enumerate() {
                    for b in &bs[i + 1..] {
                        let live = a.start < b.end && b.start < a.end;
                        let mem = a.offset < b.offset + b.size_bytes && b.offset < a.offset + a.size_bytes;
                        let grouped = !a.alias_group.is_empty() && a.alias_group == b.alias_group;
                        assert!(
                            !(live && mem && !grouped) || a.size_bytes == 0 || b.size_bytes == 0,
                            "overlap: {a:?} {b:?}"
                        );
                    }
                }
            }
        }
    }
});
