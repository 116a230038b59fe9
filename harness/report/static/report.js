
(function(){
  var bt = document.getElementById('bug-titles');
  if(bt){
    var titles = JSON.parse(bt.textContent);
    document.querySelectorAll('span.bug:not([title])').forEach(function(s){
      var t = titles[s.textContent]; if(t) s.title = t;
    });
  }
  function materialize(root){
    root.querySelectorAll('script.lazy-svg').forEach(function(s){
      s.insertAdjacentHTML('afterend', s.textContent);
      s.parentNode.removeChild(s);
    });
  }
  document.querySelectorAll('details.case').forEach(function(d){
    d.addEventListener('toggle', function(){ if(d.open) materialize(d); });
    if(d.open) materialize(d);
  });
  // open a case and draw its plots now (the toggle event comes asynchronously)
  window.reportOpenCase = function(idOrEl){
    var d = typeof idOrEl === 'string' ? document.getElementById(idOrEl) : idOrEl;
    if(d && d.tagName === 'DETAILS'){ d.open = true; materialize(d); }
    return d;
  };
  function openTarget(){
    var id = decodeURIComponent(location.hash.slice(1));
    if(!id) return;
    var el = document.getElementById(id);
    if(el && el.tagName === 'DETAILS'){ window.reportOpenCase(el); el.scrollIntoView({block:'start'}); }
  }
  window.addEventListener('hashchange', openTarget);
  openTarget();
  document.querySelectorAll('a.open-case').forEach(function(a){
    a.addEventListener('click', function(){
      var el = document.getElementById(a.getAttribute('href').slice(1));
      if(el && el.tagName === 'DETAILS') window.reportOpenCase(el);
    });
  });
  document.querySelectorAll('button.copy').forEach(function(b){
    b.addEventListener('click', function(){
      var text = b.parentNode.querySelector('pre').textContent;
      function done(ok){
        b.textContent = ok ? 'copied' : 'select + copy';
        setTimeout(function(){ b.textContent = 'copy'; }, 1500);
      }
      function fallback(){
        var r = document.createRange(); r.selectNodeContents(b.parentNode.querySelector('pre'));
        var s = window.getSelection(); s.removeAllRanges(); s.addRange(r);
        var ok = false; try { ok = document.execCommand('copy'); } catch(e) { ok = false; }
        done(ok);
      }
      try {
        if(navigator.clipboard && window.isSecureContext){
          navigator.clipboard.writeText(text).then(function(){ done(true); }, fallback);
        } else { fallback(); }
      } catch(e) { fallback(); }
    });
  });
  var f = document.getElementById('filter');
  if(f){
    f.addEventListener('input', function(){
      var q = f.value.toLowerCase();
      document.querySelectorAll('[data-case]').forEach(function(el){
        if(el.tagName === 'FIGURE') return;
        var hit = !q || el.getAttribute('data-case').toLowerCase().indexOf(q) >= 0;
        el.classList.toggle('hidden', !hit);
      });
    });
  }
  function setAll(open){
    document.querySelectorAll('details.case').forEach(function(d){
      if(d.classList.contains('hidden')) return;
      if(open) window.reportOpenCase(d); else d.open = false;
    });
  }
  var ea = document.getElementById('expand-all'), ca = document.getElementById('collapse-all');
  if(ea) ea.addEventListener('click', function(){ setAll(true); });
  if(ca) ca.addEventListener('click', function(){ setAll(false); });
})();
